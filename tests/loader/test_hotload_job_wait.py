"""``HotLoadJob.wait_done``: what ``GET /v1/hotload/{id}?wait=`` awaits, woken by the job's thread as it ends."""

from __future__ import annotations

import asyncio
import threading
import time

from ckptdelta.loader.hotload_jobs import FAILED, PREPARING, READY, SWAPPING, HotLoadJob


def _job() -> HotLoadJob:
    return HotLoadJob(id="hl-test", requested="2", target_version=2, from_version=1)


def test_a_waiter_wakes_as_another_thread_ends_the_job_not_at_its_timeout():
    job = _job()

    async def main() -> float:
        threading.Timer(0.1, lambda: setattr(job, "state", READY)).start()
        t0 = time.monotonic()
        await job.wait_done(30)
        return time.monotonic() - t0

    took = asyncio.run(main())
    assert job.done and took < 10          # woken, not timed out (a generous bound: a busy CI host)
    assert job._waiters == []


def test_every_waiter_wakes_and_a_state_that_is_not_final_wakes_none():
    job = _job()

    async def main() -> list[bool]:
        waits = [asyncio.ensure_future(job.wait_done(30)) for _ in range(3)]
        await asyncio.sleep(0.05)
        job.state = SWAPPING                  # still running: nobody wakes
        await asyncio.sleep(0.05)
        still = [not w.done() for w in waits]
        threading.Thread(target=lambda: setattr(job, "state", FAILED)).start()
        await asyncio.wait_for(asyncio.gather(*waits), 10)
        return still

    assert asyncio.run(main()) == [True, True, True]
    assert job._waiters == []


def test_a_wait_runs_out_with_the_job_still_running_and_leaves_no_waiter_behind():
    job = _job()

    async def main() -> float:
        t0 = time.monotonic()
        await job.wait_done(0.05)
        return time.monotonic() - t0

    assert asyncio.run(main()) >= 0.05
    assert job.state == PREPARING and job._waiters == []
    job.state = READY                          # no loop left to call: ending the job later is harmless


def test_waiting_on_an_ended_job_returns_at_once():
    job = _job()
    job.state = READY

    async def main() -> float:
        t0 = time.monotonic()
        await job.wait_done(30)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5
