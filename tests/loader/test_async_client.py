"""AsyncRolloutClient against live replicas (real HTTP on 127.0.0.1): a GRPO-style fan-out with asyncio.gather,
408 retried until a fleet hot-load lands, affinity, timeouts and errors."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ckptdelta.delta.errors import PolicyVersionTimeoutError, ReplicaError, SnapshotNotFoundError
from ckptdelta.loader.async_client import AsyncRolloutClient
from ckptdelta.loader.client import RolloutClient
from tests.bad_replicas import HANG, JSON_LIST, BadReplica, blackholed_url, dead_url, replica_status
from tests.replicas import PROMPT, keys_led_by, lm_dir, run, start_replica, state_bits_equal  # noqa: F401


def _count_408(rep) -> float:
    line = 'ckptdelta_requests_total{endpoint="/v1/completions",status="408"}'
    return next((float(x.split()[-1]) for x in rep.http.get("/metrics").text.splitlines() if x.startswith(line)), 0.0)


def test_a_gathered_group_retries_408_until_the_fleet_hotload_lands_then_each_key_lands_on_its_pinned_replica(
        start_replica):
    """While the whole fleet is below the floor, a keyed request goes round its replicas (each 408) and waits;
    once the hot-load landed, on its own replica (the sync client's pick) again. Through the hot-load itself a
    request may be served by the next replica of its order that reached the version first: that is the
    failover rule, and all it must hold there is the floor."""
    reps = [start_replica(1, replica_id="r0"), start_replica(1, replica_id="r1")]
    urls = [r.url for r in reps]
    # four groups of two completions, two groups led by each replica (chosen: four fixed keys all landed on one
    # replica 1 run in 8)
    led = [keys_led_by(urls, u, 2) for u in urls]
    keys = [k for pair in zip(*led) for k in pair for _ in range(2)]

    async def main() -> tuple[list[dict], dict, list[dict]]:
        async with AsyncRolloutClient(urls, ready_timeout=60, backoff_base=0.02, backoff_max=0.2) as client:
            def group() -> "asyncio.Future[list[dict]]":
                return asyncio.gather(*(client.sample_async(PROMPT, max_tokens=2, min_policy_version=2,
                                                            affinity_key=k, seed=i) for i, k in enumerate(keys)))
            sampling = group()
            while sum(_count_408(r) for r in reps) < 2 * len(keys):   # every request turned away by both
                await asyncio.sleep(0.01)
            states = await client.hotload(2)
            return await sampling, states, await group()

    outs, states, after = asyncio.run(main())
    assert {u: s["state"] for u, s in states.items()} == {u: "READY" for u in urls}
    by_url = {r.url: r.status()["replica_id"] for r in reps}
    sync = RolloutClient(urls)
    for key, out, later in zip(keys, outs, after):
        assert out["engine_data"]["policy_version"] == 2 and out["engine_data"]["policy_versions"] == [2]
        data = later["engine_data"]
        assert data["policy_version"] == 2 and data["policy_versions"] == [2]
        assert data["replica_id"] == by_url[sync.replica_for(key)]     # pinned, as the sync client pins it
    sync.close()
    assert len({o["engine_data"]["replica_id"] for o in after}) == 2    # the groups spread over the fleet


def test_a_gathered_keyed_group_fails_over_to_the_next_replica_of_each_key_when_its_own_is_stale_or_dead(
        start_replica):
    """The asyncio client's keyed requests follow the sync client's order (RolloutClient.replica_order): a group
    pinned to a replica behind the floor, or to one that died, is served at once by the next replica of its key
    instead of failing at ``ready_timeout``."""
    ahead, behind = start_replica(2, replica_id="ahead"), start_replica(1, replica_id="behind")
    urls = [ahead.url, behind.url]
    keys = keys_led_by(urls, behind.url, 6)

    async def group(client: AsyncRolloutClient, floor: int | None) -> list[dict]:
        return await asyncio.gather(*(client.sample_async(PROMPT, max_tokens=1, min_policy_version=floor,
                                                          affinity_key=k) for k in keys))

    async def main() -> tuple[list[dict], list[dict], list[dict], float]:
        async with AsyncRolloutClient(urls, ready_timeout=3, backoff_base=0.05, backoff_max=0.2) as client:
            own = await group(client, None)          # healthy and answering: their own replica
            t0 = asyncio.get_running_loop().time()
            stale = await group(client, 2)           # their own replica below the floor
            behind.close()
            dead = await group(client, None)         # their own replica dead
            return own, stale, dead, asyncio.get_running_loop().time() - t0

    own, stale, dead, took = asyncio.run(main())
    assert {o["engine_data"]["replica_id"] for o in own} == {"behind"}
    assert {o["engine_data"]["replica_id"] for o in stale + dead} == {"ahead"}
    assert all(o["engine_data"]["policy_version"] == 2 for o in stale + dead)
    assert took < 2.5                                # neither waited for the ready_timeout of 3 s
    assert AsyncRolloutClient.replica_order is RolloutClient.replica_order      # one order for both clients


def test_a_gathered_group_on_replicas_that_never_answer_a_connection_fails_at_ready_timeout():
    """As the sync client: each try connects within what is left of ``ready_timeout``, at least 0.5 s, so a group
    keyed over three replicas whose packets are dropped fails soon after ``ready_timeout`` (0.5 s), not 3 x the
    client's ``timeout`` (10 s) past it."""
    async def main(urls: list[str]) -> tuple[list, float]:
        async with AsyncRolloutClient(urls, timeout=10.0, ready_timeout=0.5, backoff_base=0.05) as client:
            t0 = asyncio.get_running_loop().time()
            out = await asyncio.gather(*(client.sample_async(PROMPT, max_tokens=1, affinity_key=f"group-{i}")
                                         for i in range(4)), return_exceptions=True)
            return out, asyncio.get_running_loop().time() - t0

    with contextlib.ExitStack() as stack:
        out, took = asyncio.run(main([stack.enter_context(blackholed_url()) for _ in range(3)]))
    assert all(isinstance(e, ReplicaError) and "ConnectTimeout" in str(e) for e in out), out
    assert took < 5.0


def test_a_gathered_group_whose_replica_drops_packets_is_served_by_the_next_after_ready_timeout(start_replica):
    """The last round, made at the deadline, is a whole round here too: keys led by a replica whose packets are
    dropped are served by the next replica of their order although ``ready_timeout`` (0.3 s) is spent by then."""
    live = start_replica(1, replica_id="live")

    async def main(urls: list[str], keys: list[str]) -> list[dict]:
        async with AsyncRolloutClient(urls, timeout=10.0, ready_timeout=0.3, backoff_base=0.05) as client:
            return await asyncio.gather(*(client.sample_async(PROMPT, max_tokens=1, affinity_key=k) for k in keys))

    with blackholed_url() as silent:
        out = asyncio.run(main([silent, live.url], keys_led_by([silent, live.url], silent, 3)))
    assert {o["engine_data"]["replica_id"] for o in out} == {"live"}


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
