"""RolloutClient and the serve/hotload commands against live replicas (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ckptdelta.delta.errors import (HotLoadConflictError, HotLoadError, PolicyVersionTimeoutError, ReplicaError,
                                    RunMismatchError, SnapshotNotFoundError)
from ckptdelta.cli import serve as cli
from ckptdelta.loader.client import RolloutClient
from tests.bad_replicas import HTML, BadReplica, blackholed_url, dead_url
from tests.replicas import (PROMPT, corrupt_delta, keys_led_by, lm_dir, publish_run, run, start_replica,  # noqa: F401
                            state_bits_equal)
from tests import REPO


def _requests_with_status(rep, status: int) -> float:
    text = rep.http.get("/metrics").text
    line = f'ckptdelta_requests_total{{endpoint="/v1/completions",status="{status}"}}'
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_round_robin_spreads_requests_and_affinity_pins_a_group(start_replica):
    reps = [start_replica(replica_id="r0"), start_replica(replica_id="r1")]
    with RolloutClient([r.url for r in reps]) as client:
        ids = [client.sample(PROMPT, max_tokens=1)["engine_data"]["replica_id"] for _ in range(4)]
        assert sorted(ids) == ["r0", "r0", "r1", "r1"] and ids[0] != ids[1]
        for key in ("group-1", "group-2", "conversation-9"):
            pinned = {client.sample(PROMPT, max_tokens=1, affinity_key=key)["engine_data"]["replica_id"]
                      for _ in range(3)}
            assert len(pinned) == 1
        spread = {client.replica_for(f"g{i}") for i in range(16)}
        assert spread == {r.url for r in reps}  # keys do not all land on one replica
        out = client.sample([{"role": "user", "content": "hi"}], n=2, max_tokens=2, logprobs=True, top_logprobs=2)
        assert out["object"] == "chat.completion" and len(out["choices"]) == 2
        assert len(out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_a_keyed_request_moves_to_the_next_replica_in_its_order_when_its_own_is_behind_the_floor_or_dead(
        start_replica):
    """affinity_key prefers its replica while that one serves, and fails over, at once, to the next in the key's
    own stable order when it cannot: a replica behind ``min_policy_version`` (408) or a dead one no longer holds
    the request until ``ready_timeout`` while another serves it."""
    ahead, behind = start_replica(2, replica_id="ahead"), start_replica(1, replica_id="behind")
    urls = [ahead.url, behind.url]
    with RolloutClient(urls, ready_timeout=3, backoff_base=0.05, backoff_max=0.2) as client:
        key, = keys_led_by(urls, behind.url)
        # healthy and answering: the key's own replica serves it, every time
        assert {client.sample(PROMPT, max_tokens=1, affinity_key=key)["engine_data"]["replica_id"]
                for _ in range(3)} == {"behind"}
        # its replica below the floor: the next in its order, at once
        t0 = time.monotonic()
        out = client.sample(PROMPT, max_tokens=1, min_policy_version=2, affinity_key=key)
        assert out["engine_data"]["replica_id"] == "ahead" and out["engine_data"]["policy_version"] == 2
        assert time.monotonic() - t0 < 2.5
        # its replica dead: the next in its order, at once
        behind.close()
        t0 = time.monotonic()
        assert client.sample(PROMPT, max_tokens=1, affinity_key=key)["engine_data"]["replica_id"] == "ahead"
        assert time.monotonic() - t0 < 2.5
        # the order: the same from any client and however the URLs are listed; the key's own replica first
        assert client.replica_order(key) == RolloutClient(urls[::-1]).replica_order(key) == [behind.url, ahead.url]
    with RolloutClient([behind.url], ready_timeout=0.5, backoff_base=0.05) as alone:     # no other: as before
        with pytest.raises(ReplicaError, match="refused|Connect"):
            alone.sample(PROMPT, max_tokens=1, affinity_key=key)


def test_replicas_that_never_answer_a_connection_hold_a_request_no_longer_than_ready_timeout():
    """Each try waited the client's ``timeout`` for its connection, and a keyed round tries the whole order: three
    replicas whose packets are dropped held a request 3 x 10 s past a ``ready_timeout`` of 0.5 s (an unkeyed one
    10 s). A try now connects within what is left of ``ready_timeout``, at least 0.5 s (MIN_TRY_S)."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(blackholed_url()) for _ in range(3)]
        with RolloutClient(urls, timeout=10.0, ready_timeout=0.5, backoff_base=0.05) as client:
            for key in ("group-0", None):
                t0 = time.monotonic()
                with pytest.raises(ReplicaError, match="within the ready_timeout of 0.5s.*ConnectTimeout"):
                    client.sample(PROMPT, max_tokens=1, affinity_key=key)
                assert time.monotonic() - t0 < 5.0, key       # 0.5 + 2 x 0.5 s keyed; 10-30 s before


def test_the_round_at_the_deadline_still_tries_every_replica_of_a_keys_order(start_replica):
    """A key whose own replica is dead or drops packets is served by the next of its order also when
    ``ready_timeout`` is spent by then (0 s, or less than the try's connect timeout): the last round is a whole
    round, each of its tries given at least MIN_TRY_S to connect."""
    live = start_replica(1, replica_id="live")
    with blackholed_url() as silent:
        for own, ready in ((dead_url(), 0.0), (silent, 0.3)):
            with RolloutClient([own, live.url], timeout=10.0, ready_timeout=ready, backoff_base=0.05) as client:
                key, = keys_led_by([own, live.url], own)
                t0 = time.monotonic()
                out = client.sample(PROMPT, max_tokens=1, affinity_key=key)
                assert out["engine_data"]["replica_id"] == "live"
                assert time.monotonic() - t0 < 5.0, own      # not the 10 s connect timeout


def test_sample_retries_408_until_the_hotload_lands(start_replica):
    rep = start_replica(1)
    result: dict = {}
    with RolloutClient([rep.url], ready_timeout=60, backoff_base=0.02, backoff_max=0.2) as client:
        t = threading.Thread(target=lambda: result.setdefault(
            "out", client.sample(PROMPT, max_tokens=2, min_policy_version=2)))
        t.start()
        deadline = time.monotonic() + 30
        while _requests_with_status(rep, 408) < 2:  # the client was turned away, and came back
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        states = client.hotload(2)
        t.join(60)
    assert states[rep.url]["state"] == "READY" and states[rep.url]["target_version"] == 2
    assert result["out"]["engine_data"]["policy_version"] == 2


def test_sample_gives_up_after_ready_timeout_and_raises_on_bad_requests(start_replica):
    rep = start_replica(1)
    with RolloutClient([rep.url], ready_timeout=0.5, backoff_base=0.05) as client:
        with pytest.raises(PolicyVersionTimeoutError) as info:
            client.sample(PROMPT, max_tokens=1, min_policy_version=99)
        assert isinstance(info.value, HotLoadError) and isinstance(info.value, TimeoutError)
        assert "99" in str(info.value)
        with pytest.raises(ReplicaError, match="400"):
            client.sample(PROMPT, n=0)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with RolloutClient([dead], ready_timeout=0.3, backoff_base=0.05) as client:
        with pytest.raises(ReplicaError, match="127.0.0.1"):
            client.sample(PROMPT, max_tokens=1)
        assert "error" in client.status()[dead]


def test_fleet_hotload_waits_for_every_replica_at_one_version(start_replica, run):
    reps = [start_replica(1, replica_id="r0"), start_replica(1, replica_id="r1")]
    with RolloutClient([r.url for r in reps]) as client:
        states = client.hotload("latest")
        assert set(states) == {r.url for r in reps}
        assert all(s["state"] == "READY" and s["target_version"] == run.latest for s in states.values())
        status = client.status()
        assert [status[r.url]["policy_version"] for r in reps] == [run.latest, run.latest]
        for r in reps:
            assert state_bits_equal(r.engine.model, run.truth[run.latest]) == []
        out = client.sample(PROMPT, max_tokens=1, min_policy_version=run.latest)
        assert out["engine_data"]["policy_version"] == run.latest
        with pytest.raises(SnapshotNotFoundError) as info:
            client.hotload(99)
        assert info.value.states[reps[0].url]["status"] == 404
        accepted = client.hotload(2, wait=False)  # rollback, not waited for
        assert {s["target_version"] for s in accepted.values()} == {2}


def test_fleet_hotload_raises_with_per_replica_states_on_failure_and_conflict(start_replica, lm_dir, tmp_path):
    run = publish_run(str(tmp_path / "bucket" / "run"), lm_dir, n_versions=3)
    try:
        reps = [start_replica(1, bucket=run.url, replica_id=f"r{i}") for i in range(2)]
        corrupt_delta(run, 2)
        with RolloutClient([r.url for r in reps]) as client:
            with pytest.raises(HotLoadError) as info:
                client.hotload(2, timeout=60)
            states = info.value.states
            assert "FAILED" in {s["state"] for s in states.values()} and "FAILED" in str(info.value)
            assert all(client.status()[r.url]["policy_version"] == 1 for r in reps)

            with reps[1].engine.step():  # r1 stuck in the swap of a hot-load to v0
                job = reps[1].post("/v1/hotload", {"snapshot": 0}).json()
                reps[1].wait(job["id"], states=("SWAPPING",))
                with pytest.raises(HotLoadConflictError) as info:
                    client.hotload(1)  # r0 is already there; r1 is busy with another target
                assert info.value.states[reps[1].url]["status"] == 409
            assert reps[1].wait(job["id"])["state"] == "READY"
    finally:
        run.close()


def test_fleet_hotload_loads_the_live_replica_then_raises_for_the_dead_the_other_run_and_the_garbage_one(
        start_replica, run, lm_dir, tmp_path):
    """Issue 39, the fan-out class: a dead first replica raised before any other was asked to hot-load; one of
    another run was hot-loaded to that run's version of the same number; an answer that is not JSON raised
    JSONDecodeError. Now every replica is asked at once, the live one is READY, the one of another run keeps
    what it serves, and the error (the most telling kind: RunMismatchError) carries every replica's row."""
    other = publish_run(str(tmp_path / "other" / "run"), lm_dir, n_versions=2)
    try:
        live, theirs = start_replica(0, replica_id="live"), start_replica(0, bucket=other.url, replica_id="theirs")
        dead = dead_url()
        with BadReplica({("GET", "/"): HTML, ("POST", "/"): HTML}) as html, \
                RolloutClient([dead, live.url, theirs.url, html.url], timeout=10, ready_timeout=0.5) as client:
            with pytest.raises(RunMismatchError) as info:
                client.hotload(1, timeout=60)
            states = info.value.states
            assert states[live.url]["state"] == "READY" and states[live.url]["target_version"] == 1
            assert state_bits_equal(live.engine.model, run.truth[1]) == []
            assert states[theirs.url]["state"] == "REJECTED" and "serves run" in states[theirs.url]["error"]
            assert theirs.status()["policy_version"] == 0           # not moved to the other run's v1
            assert states[dead]["state"] == "UNREACHABLE" and "refused the connection" in states[dead]["error"]
            assert "still refused after 0.5s of waiting for it to start" in states[dead]["error"]  # ready_timeout
            assert states[html.url]["state"] == "REJECTED" and "not JSON" in states[html.url]["error"]
            assert "UNREACHABLE" in str(info.value) and theirs.url in str(info.value)

            status = client.status()
            assert status[live.url]["policy_version"] == 1 and status[html.url]["state"] == "REJECTED"
            with pytest.raises(ReplicaError, match="not JSON"):     # sampling: named, not a JSONDecodeError
                client.sample(PROMPT, max_tokens=1, affinity_key=keys_led_by(client.replicas, html.url)[0])
    finally:
        other.close()


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ckptdelta")
    cli.add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def _cli(*argv: str) -> int:
    args = _parse(*argv)
    return args.func(args)


def test_hotload_command_prints_state_and_exit_status(start_replica, capsys, lm_dir, tmp_path):
    rep = start_replica(1, api_key="k3y")
    assert _cli("hotload", rep.url, "2", "--wait", "--api-key", "k3y", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out[rep.url]["state"] == "READY" and out[rep.url]["target_version"] == 2
    assert _cli("hotload", rep.url, "v00000099", "--api-key", "k3y") == 1
    assert _cli("hotload", rep.url, "latest", "--api-key", "wrong") == 1
    assert "401" in capsys.readouterr().err

    bad = publish_run(str(tmp_path / "bucket" / "run"), lm_dir, n_versions=3)
    try:
        rep2 = start_replica(1, bucket=bad.url)
        corrupt_delta(bad, 2)
        assert _cli("hotload", rep2.url, "2", "--wait") == 1
        assert "FAILED" in capsys.readouterr().out
    finally:
        bad.close()


def test_serve_command_runs_a_replica_from_a_bucket_on_the_port_it_picked(run, tmp_path):
    env = {**os.environ, "CKPTDELTA_API_KEY": "env-key"}
    root = REPO
    proc = subprocess.Popen([sys.executable, "-m", "ckptdelta", "serve", "--bucket", run.url, "--snapshot", "1",
                             "--port", "0", "--replica-id", "cli-replica", "--cache-dir", str(tmp_path / "cache")],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    announced: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace"))
            if "serving policy version" in lines[-1] and not announced:
                announced.append(lines[-1])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120) and announced, "".join(lines)[-3000:]
        port = int(announced[0].split("http://127.0.0.1:")[1].split()[0])  # the log names the port --port 0 picked
        assert port != 0
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "".join(lines)[-3000:]
            try:
                r = httpx.get(url + "/v1/status", headers={"Authorization": "Bearer env-key"}, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 200 and r.json()["policy_version"] == 1 and r.json()["replica_id"] == "cli-replica"
        assert httpx.get(url + "/v1/status").status_code == 401
        with RolloutClient([url], api_key="env-key") as client:
            assert client.hotload("latest")[url]["target_version"] == run.latest
            out = client.sample(PROMPT, max_tokens=2, min_policy_version=run.latest)
            assert out["engine_data"]["replica_id"] == "cli-replica"
        # without -v, serve says at INFO what it does: one line per hot-load, not one per HTTP request
        deadline = time.monotonic() + 30
        while not any(" READY: " in ln for ln in lines):
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.1)
        done = next(ln for ln in lines if " READY: " in ln)
        assert " INFO " in done and f"v00000001 -> v{run.latest:08d}" in done
        assert "fetched, prepare " in done and ", pause " in done and "verified" in done
        assert not [ln for ln in lines if "HTTP Request" in ln or "hotswap" in ln], "".join(lines)[-3000:]
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_holds_its_port_from_the_first_check_until_it_serves(run):
    """vLLM takes minutes to start, and picks free ports of its own meanwhile: a port only checked and let go
    was handed to vLLM once and the replica could not listen. From the checks on, the port stays bound."""
    args = _parse("serve", "--bucket", run.url, "--port", "0")
    snapshot, sock = cli._check_before_loading(args)
    try:
        assert snapshot == run.latest and args.port == sock.getsockname()[1] != 0
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", args.port))
        assert taken.value.errno == errno.EADDRINUSE
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", args.port))  # bound, not yet listening: nothing waits in a backlog
    finally:
        sock.close()
    with socket.socket() as other:
        other.bind(("127.0.0.1", args.port))  # let go once serving ends


def _completion_requests(rep) -> dict[str, float]:
    prefix = 'ckptdelta_requests_total{endpoint="/v1/completions",status="'
    return {x[len(prefix):].split('"')[0]: float(x.split()[-1])
            for x in rep.http.get("/metrics").text.splitlines() if x.startswith(prefix)}


@pytest.mark.parametrize("kind", ["RolloutClient", "AsyncRolloutClient", "SamplingClient"])
def test_a_generation_longer_than_the_client_timeout_is_waited_for_and_one_past_sample_timeout_is_sent_once(
        start_replica, kind):
    """A sampling answer comes when its generation ends: ``timeout`` (connecting, control calls) does not bound
    it, ``sample_timeout`` does, and a request past it is not sent again (the replica stops generating it)."""
    import asyncio

    from ckptdelta import SampleTimeoutError
    from ckptdelta.loader.async_client import AsyncRolloutClient
    from ckptdelta.loader.sampling import ModelInput, SamplingClient, SamplingParams

    rep = start_replica(1)
    ids = rep.engine.encode(PROMPT)

    def sample(**options):
        if kind == "RolloutClient":
            with RolloutClient([rep.url], **options) as c:
                return len(c.sample(ids, n=2, max_tokens=400, ignore_eos=True)["choices"][0]["token_ids"])
        if kind == "AsyncRolloutClient":
            async def go():
                async with AsyncRolloutClient([rep.url], **options) as c:
                    out = await c.sample_async(ids, n=2, max_tokens=400, ignore_eos=True)
                    return len(out["choices"][0]["token_ids"])
            return asyncio.run(go())
        with SamplingClient(rep.url, **options) as c:
            out = c.sample(ModelInput.from_ints(ids), 2, SamplingParams(max_tokens=400))
            return len(out.sequences[0].tokens)

    def first_step_waits(seconds: float) -> tuple[threading.Event, object]:
        """The generation's first forward step waits up to ``seconds`` (until the event is set): it outlasts the
        client's 0.05 s however soon its sampled tokens reach EOS (the SamplingClient sends no ignore_eos, and
        a generation that ended in 20 ms once proved nothing), on a quiet machine as on a loaded one."""
        release, waited = threading.Event(), []

        def hook(module, args, output):
            if not waited:
                waited.append(True)
                release.wait(seconds)

        return release, rep.engine.model.register_forward_hook(hook)

    before = _completion_requests(rep)
    _, handle = first_step_waits(0.2)
    t0 = time.monotonic()
    try:
        assert 1 <= sample(timeout=0.05) <= 400
    finally:
        handle.remove()
    took = time.monotonic() - t0
    assert took > 0.2, f"the generation took {took:.3f}s: too short to prove anything"
    counts = _completion_requests(rep)
    assert counts.get("200", 0) == before.get("200", 0) + 1 and sum(counts.values()) == sum(before.values()) + 1

    finished = rep.status()["engine"]["finished"]
    release, handle = first_step_waits(30.0)            # held until the client gave up
    try:
        with pytest.raises(SampleTimeoutError) as info:
            sample(sample_timeout=0.05, ready_timeout=30)
    finally:
        release.set()
        handle.remove()
    assert isinstance(info.value, ReplicaError) and isinstance(info.value, TimeoutError)
    assert rep.url in str(info.value) and "0.05s" in str(info.value) and "not sent again" in str(info.value)
    deadline = time.monotonic() + 30
    while _completion_requests(rep).get("499", 0) < before.get("499", 0) + 1:    # the replica saw its client go
        assert time.monotonic() < deadline
        time.sleep(0.01)
    after = _completion_requests(rep)
    assert sum(after.values()) == sum(counts.values()) + 1, after           # one request, never sent again
    while rep.status()["engine"]["generating"]:        # a decode loop stops at its next token
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert rep.status()["engine"]["finished"] == finished         # nor generated to its end for nobody


def test_a_replica_whose_engine_timed_out_is_not_asked_again_but_a_proxys_504_is():
    """A replica's 504 ``engine_timeout`` says the generation outlived its ``--request-timeout``: another try
    would spend as long and end the same way. A 504 without it (a proxy in front of a replica that is down) is
    retried as before."""
    from ckptdelta import SampleTimeoutError

    engine_timeout = (504, "application/json", {"error": {"type": "engine_timeout", "message": "vLLM at "
                      "http://127.0.0.1:1 did not answer within the request timeout (600 s, --request-timeout)"}})
    with BadReplica({("POST", "/v1/completions"): engine_timeout}) as bad, \
            RolloutClient([bad.url], ready_timeout=5, backoff_base=0.01) as client:
        with pytest.raises(SampleTimeoutError, match="--request-timeout.*not sent again") as info:
            client.sample(PROMPT, max_tokens=1)
        assert bad.url in str(info.value) and bad.requests == [("POST", "/v1/completions")]
    gateway = (504, "text/html", b"<html>504 Gateway Time-out</html>")
    with BadReplica({("POST", "/v1/completions"): gateway}) as bad, \
            RolloutClient([bad.url], ready_timeout=0.5, backoff_base=0.01) as client:
        with pytest.raises(ReplicaError, match="failed on every try") as info:
            client.sample(PROMPT, max_tokens=1)
        assert not isinstance(info.value, SampleTimeoutError) and len(bad.requests) > 1
