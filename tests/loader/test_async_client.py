"""AsyncRolloutClient against live replicas (real HTTP on 127.0.0.1): a GRPO-style fan-out with asyncio.gather,
408 retried until a fleet hot-load lands, affinity, timeouts and errors."""

from __future__ import annotations

import asyncio

import pytest

from ckptdelta.delta.errors import PolicyVersionTimeoutError, ReplicaError, SnapshotNotFoundError
from ckptdelta.loader.async_client import AsyncRolloutClient
from ckptdelta.loader.client import RolloutClient
from tests.bad_replicas import HANG, JSON_LIST, BadReplica, dead_url, replica_status
from tests.replicas import PROMPT, lm_dir, run, start_replica, state_bits_equal  # noqa: F401


def _count_408(rep) -> float:
    line = 'ckptdelta_requests_total{endpoint="/v1/completions",status="408"}'
    return next((float(x.split()[-1]) for x in rep.http.get("/metrics").text.splitlines() if x.startswith(line)), 0.0)


def test_a_gathered_group_retries_408_until_the_fleet_hotload_lands_each_on_its_pinned_replica(start_replica):
    reps = [start_replica(1, replica_id="r0"), start_replica(1, replica_id="r1")]
    urls = [r.url for r in reps]
    keys = [f"group-{i // 2}" for i in range(8)]          # four groups of two completions

    async def main() -> tuple[list[dict], dict]:
        async with AsyncRolloutClient(urls, ready_timeout=60, backoff_base=0.02, backoff_max=0.2) as client:
            sampling = asyncio.gather(*(client.sample_async(PROMPT, max_tokens=2, min_policy_version=2,
                                                            affinity_key=k, seed=i) for i, k in enumerate(keys)))
            while sum(_count_408(r) for r in reps) < len(keys):     # every request turned away at least once
                await asyncio.sleep(0.01)
            states = await client.hotload(2)
            return await sampling, states

    outs, states = asyncio.run(main())
    assert {u: s["state"] for u, s in states.items()} == {u: "READY" for u in urls}
    by_url = {r.url: r.status()["replica_id"] for r in reps}
    sync = RolloutClient(urls)
    for key, out in zip(keys, outs):
        data = out["engine_data"]
        assert data["policy_version"] == 2 and data["policy_versions"] == [2]
        assert data["replica_id"] == by_url[sync.replica_for(key)]     # pinned, as the sync client pins it
    sync.close()
    assert len({o["engine_data"]["replica_id"] for o in outs}) == 2    # the groups spread over the fleet


def test_sample_async_gives_up_after_ready_timeout_and_raises_other_errors_at_once(start_replica):
    rep = start_replica(1)

    async def main() -> None:
        async with AsyncRolloutClient([rep.url], ready_timeout=0.5, backoff_base=0.02, backoff_max=0.1) as client:
            with pytest.raises(PolicyVersionTimeoutError, match="policy version 99"):
                await client.sample_async(PROMPT, max_tokens=1, min_policy_version=99)
            with pytest.raises(ReplicaError, match="400"):
                await client.sample_async(PROMPT, max_tokens=0)
            with pytest.raises(SnapshotNotFoundError) as e:         # the fleet hot-load's refusal, with states
                await client.hotload(99)
            assert rep.url in e.value.states
            chat = await client.sample_async([{"role": "user", "content": "hi"}], n=2, max_tokens=2)
            assert chat["object"] == "chat.completion" and len(chat["choices"]) == 2
            assert (await client.status())[rep.url]["policy_version"] == 1

    asyncio.run(main())


def test_fleet_hotload_async_loads_the_live_replica_beside_dead_hung_and_garbage_ones_then_raises(start_replica, run):
    """Issue 39, the fan-out class: the async hot-load asked the first replica alone first (a dead one raised
    before any other was asked), and a garbage answer raised KeyError. Now the live replica, listed last, is
    READY at the version, and ReplicaError carries a row for each other member."""
    live = start_replica(0)
    dead = dead_url()
    bad_post = (200, "application/json", replica_status(live.status()["run_id"], 0))

    async def main(urls: list[str]) -> tuple[dict, dict]:
        async with AsyncRolloutClient(urls, timeout=2, ready_timeout=0.5) as client:
            with pytest.raises(ReplicaError) as info:
                await client.hotload("latest", timeout=60)
            return info.value.states, await client.status()

    with BadReplica({("GET", "/"): HANG}) as hung, BadReplica({("GET", "/"): JSON_LIST}) as listing, \
            BadReplica({("GET", "/v1/status"): bad_post, ("POST", "/v1/hotload"): JSON_LIST}) as post:
        urls = [dead, hung.url, listing.url, post.url, live.url]
        states, status = asyncio.run(main(urls))
    assert states[live.url]["state"] == "READY" and states[live.url]["target_version"] == run.latest
    assert state_bits_equal(live.engine.model, run.truth[run.latest]) == []
    assert {u: states[u]["state"] for u in urls[:4]} == {dead: "UNREACHABLE", hung.url: "UNREACHABLE",
                                                          listing.url: "REJECTED", post.url: "REJECTED"}
    assert "did not answer in time" in states[hung.url]["error"]
    assert "still refused after 0.5s of waiting for it to start" in states[dead]["error"]    # its ready_timeout
    assert "POST /v1/hotload" in states[post.url]["error"] and "not an object" in states[post.url]["error"]
    assert status[live.url]["policy_version"] == run.latest
    assert [status[u]["state"] for u in urls[:3]] == ["UNREACHABLE", "UNREACHABLE", "REJECTED"]
