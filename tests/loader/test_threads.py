"""ckptdelta.loader.threads: the kept daemon threads a replica hands its hot-loads, fetches and staging to."""

from __future__ import annotations

import threading
import time

import pytest

from ckptdelta.loader import threads as threads_mod
from ckptdelta.loader.threads import Threads


def test_tasks_one_after_another_run_on_one_kept_daemon_thread():
    pool = Threads(4, "t-kept")
    names = [pool.submit(lambda: threading.current_thread()).result(timeout=10) for _ in range(5)]
    assert len(set(names)) == 1 and names[0].daemon and names[0].name == "t-kept-1"
    assert pool.alive == 1 and pool.busy == 0


def test_at_most_n_run_at_once_and_the_rest_wait_their_turn():
    pool = Threads(2, "t-bound")
    gate = threading.Event()
    running, order = [], []
    lock = threading.Lock()

    def task(i):
        with lock:
            running.append(i)
        gate.wait(10)
        with lock:
            order.append(i)
        return i

    futs = [pool.submit(task, i) for i in range(5)]
    deadline = time.monotonic() + 10
    while len(running) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    assert sorted(running) == [0, 1] and pool.busy == 2 and pool.alive == 2
    gate.set()
    assert [f.result(timeout=10) for f in futs] == [0, 1, 2, 3, 4]
    assert sorted(order) == [0, 1, 2, 3, 4] and pool.alive == 2 and pool.busy == 0
    one = Threads(1, "t-order")                      # one thread: in the order handed over
    seen: list[int] = []
    for f in [one.submit(seen.append, i) for i in range(20)]:
        f.result(timeout=10)
    assert seen == list(range(20))


def test_a_task_cancelled_before_it_starts_never_runs_and_an_error_reaches_its_future():
    pool = Threads(1, "t-cancel")
    gate = threading.Event()
    ran = []
    first = pool.submit(gate.wait, 10)
    skipped = pool.submit(ran.append, "skipped")
    assert skipped.cancel()
    failing = pool.submit(lambda: 1 / 0)
    gate.set()
    assert first.result(timeout=10) is True
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    assert pool.submit(ran.append, "after").result(timeout=10) is None
    assert ran == ["after"] and pool.busy == 0


def test_an_idle_thread_ends_and_the_next_task_starts_another(monkeypatch):
    monkeypatch.setattr(threads_mod, "IDLE_EXIT_S", 0.05)
    pool = Threads(2, "t-idle")
    first = pool.submit(threading.current_thread).result(timeout=10)
    first.join(10)
    assert not first.is_alive() and pool.alive == 0
    monkeypatch.setattr(threads_mod, "IDLE_EXIT_S", 60.0)
    second = pool.submit(threading.current_thread).result(timeout=10)
    assert second is not first and second.is_alive() and pool.alive == 1


def test_no_thread_count_below_one():
    with pytest.raises(ValueError, match="at least one thread"):
        Threads(0, "t-none")
