"""A replica that is starting: what it answers (STARTING, not a refusal) and one rule for waiting on it in the sync
client, the asyncio client and ``ckptdelta hotload`` (loader/starting.py, loader/fleet.py StartWait).

Real parts: replicas are the real app under uvicorn on 127.0.0.1, a starting one is the real STARTING server on
the replica's own socket; and a real ``ckptdelta serve`` process, held in the middle of its start by its bucket
(a real S3 API server, moto, behind a proxy that holds the snapshot's weights until the test lets them through),
then stopped with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ckptdelta.cli import main
from ckptdelta.delta.errors import HotLoadTimeoutError
from ckptdelta.loader.async_client import AsyncRolloutClient
from ckptdelta.loader.client import RolloutClient
from ckptdelta.loader.starting import StartingServer
from tests.bad_replicas import dead_url
from tests.faultproxy import FaultProxy
from tests.lm import hf_extra_files, rl_step
from tests.replicas import lm_dir, run, start_replica, state_bits_equal  # noqa: F401
from tests.servers import free_port
from tests import REPO

ROOT = REPO


def _until(predicate, what: str, alive=lambda: True, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert alive(), f"ended before: {what}"
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _hotload_with(kind: str, urls: list[str], out: dict) -> None:
    """A fleet hot-load of latest, waiting up to 120 s for starting replicas, by ``kind``: the sync client, the
    async client or the command."""
    if kind == "sync":
        with RolloutClient(urls, ready_timeout=120) as client:
            out["states"] = client.hotload("latest")
    elif kind == "async":
        async def go() -> dict:
            async with AsyncRolloutClient(urls, ready_timeout=120) as client:
                return await client.hotload("latest")
        out["states"] = asyncio.run(go())
    else:
        out["rc"] = main(["hotload", *urls, "latest", "--wait", "--timeout", "120", "--json"])


@pytest.mark.parametrize("kind", ["sync", "async", "cli"])
def test_every_client_waits_for_a_replica_that_refuses_then_answers_starting_and_hot_loads_it_once_up(
        kind, start_replica, run, capsys):
    """Issue 41, item 5: ``AsyncRolloutClient.hotload`` (and the sync client's) failed at once on a replica still
    starting ("unreachable for hot-load") despite ready_timeout; only ``hotload --wait`` waited. One rule now: a
    replica refusing connections (serve before its checks end) or answering STARTING (its engine loading) is
    asked again until ready_timeout, while the others go on."""
    starting = start_replica(1, replica_id="starting", listen=False)      # bound, refusing connections
    live = start_replica(1, replica_id="live")
    out: dict = {}
    t = threading.Thread(target=_hotload_with, args=(kind, [starting.url, live.url], out))
    t.start()
    gate = None
    try:
        _until(lambda: live.status()["policy_version"] == run.latest, "the live replica hot-loaded", t.is_alive)
        # the same port, as serve's once its checks are done: STARTING while the engine loads
        gate = StartingServer(starting.server.sock, replica_id="starting", engine="reference").start()
        _until(lambda: gate.answered >= 2, "the starting replica asked again", t.is_alive)
        answer = httpx.get(starting.url + "/v1/status")       # 503: a poll until 200 still waits for it
        assert answer.status_code == 503 and answer.json()["state"] == "STARTING"
    finally:
        if gate is not None:
            gate.stop()
        starting.listen()          # the app takes the socket over: what connects now is served
        t.join(120)
    if kind == "cli":
        assert out["rc"] == 0
        states = json.loads(capsys.readouterr().out)
    else:
        states = out["states"]
    assert [(states[r.url]["state"], states[r.url]["target_version"]) for r in (starting, live)] == \
        [("READY", run.latest)] * 2
    assert state_bits_equal(starting.engine.model, run.truth[run.latest]) == []


def test_a_replica_still_starting_at_the_ready_timeout_is_a_row_of_its_own_and_status_shows_it_starting(
        start_replica, run, capsys):
    starting = start_replica(1, replica_id="starting", listen=False)
    live = start_replica(1, replica_id="live")
    dead = dead_url()
    gate = StartingServer(starting.server.sock, replica_id="starting", engine="reference",
                          run_id=live.status()["run_id"], version=1).start()
    try:
        with RolloutClient([starting.url, live.url], ready_timeout=0.5) as client:
            with pytest.raises(HotLoadTimeoutError) as info:
                client.hotload("latest")
        row = info.value.states[starting.url]
        assert row["state"] == "STARTING" and row["policy_version"] is None
        assert row["error"] == f"replica {starting.url} is still STARTING after 0.5s of waiting for it to start"
        assert info.value.states[live.url]["state"] == "READY"

        assert main(["hotload", starting.url, "latest"]) == 1                 # without --wait: asked once
        assert "is still STARTING (not waited for)" in capsys.readouterr().err
        assert main(["status", starting.url, dead, "--json"]) == 1            # the dead one did not answer
        states = json.loads(capsys.readouterr().out)
        assert states[starting.url]["state"] == "STARTING" and states[starting.url]["starting"]["version"] == 1
        assert states[dead]["state"] == "UNREACHABLE" and "refused" in states[dead]["error"]
        r = httpx.post(starting.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "replica_starting" and r.headers["retry-after"]
        assert httpx.get(starting.url + "/health").json() == {"ok": False, "policy_version": None,
                                                              "state": "STARTING"}
    finally:
        gate.stop()


def test_serve_answers_starting_while_its_engine_loads_and_status_tells_it_from_a_stopped_replica(
        lm_dir, s3_root, s3_endpoint, tmp_path, capsys):
    """Issue 41, item 5: ``ckptdelta status`` could not tell a starting replica from a dead one (both refused
    connections). A real ``serve`` held while it fetches its snapshot's weights answers STARTING (its run, the
    version it loads), refuses sampling with 503 until it serves, and the CLI waits for it with --wait only;
    once stopped it is UNREACHABLE."""
    from ckptdelta.publisher import Publisher
    from safetensors.torch import load_file

    url, options = s3_root
    weights = load_file(os.path.join(lm_dir, "model.safetensors"))
    with Publisher(url, storage_options=options, extra_files=hf_extra_files(lm_dir), progress=False) as pub:
        pub.publish(weights, 0)
        new = rl_step(weights, seed=5)
        pub.publish(new, 1)
        run_id = pub.run_id
    with FaultProxy(s3_endpoint) as proxy:
        proxy.hold(lambda method, path: method == "GET" and path.endswith(".safetensors"))
        through = {**options, "client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {"read_timeout": 600}}
        port = free_port()
        replica = f"http://127.0.0.1:{port}"
        log_path = tmp_path / "serve.log"
        proc = subprocess.Popen([sys.executable, "-m", "ckptdelta", "serve", "--bucket", url, "--snapshot", "0",
                                 "--storage-options", json.dumps(through), "--storage-timeout", "600",
                                 "--port", str(port), "--replica-id", "held"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
        try:
            alive = lambda: proc.poll() is None        # noqa: E731
            _until(lambda: proxy.snapshot().get("held", 0) >= 1, "serve fetching its weights", alive, timeout=300)
            dead = dead_url()
            assert main(["status", replica, dead]) == 1
            cap = capsys.readouterr()
            rows = {ln.split()[0]: ln.split() for ln in cap.out.splitlines()[1:]}
            assert rows[replica][1:4] == ["STARTING", "-", run_id] and rows[dead][1] == "UNREACHABLE"
            answer = httpx.get(replica + "/v1/status")
            st = answer.json()
            assert answer.status_code == 503 and answer.headers["retry-after"]
            assert st["state"] == "STARTING" and st["replica_id"] == "held" and st["starting"]["version"] == 0
            sampled = httpx.post(replica + "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
            assert sampled.status_code == 503 and sampled.json()["error"]["type"] == "replica_starting"

            assert main(["hotload", replica, "1"]) == 1                      # without --wait: not waited for
            assert "STARTING" in capsys.readouterr().out
            assert main(["hotload", replica, "1", "--wait", "--timeout", "1"]) == 1
            assert "still STARTING after 1s of waiting for it to start" in capsys.readouterr().out

            proxy.release()
            assert main(["hotload", replica, "1", "--wait", "--timeout", "300", "--json"]) == 0
            done = json.loads(capsys.readouterr().out)[replica]
            assert done["state"] == "READY" and done["target_version"] == 1 and done["from_version"] == 0

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0, log_path.read_text(errors="replace")[-3000:]
            assert main(["status", replica]) == 1
            cap = capsys.readouterr()
            assert cap.out.splitlines()[1].split()[1] == "UNREACHABLE" and "refused the connection" in cap.err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert "Traceback" not in log_path.read_text(errors="replace")
