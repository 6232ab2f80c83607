"""A replica stopped by any signal a supervisor sends, in any phase of a hot-load, ends the pause it began.

Real ``ckptdelta serve`` processes and real signals (SIGTERM, SIGINT, SIGHUP). A test-only hold
(``ckptdelta.loader.stopping.HOLD_ENV``) keeps the replica's hot-load in a named phase (prepare, pause, proof, resume)
until the signal has come, so each signal lands in the phase its test names, whatever the machine's load.
After each stop: exit status 0, no traceback, the hot-load ended before the engine was closed (dropped while
preparing; run to its end, its pause over, from the pause on), nothing of the replica left on the host (and,
owning vLLM, none of vLLM's processes). The cells of a vLLM the replica started are in
tests/loader/engines/vllm/test_vllm_stops.py, those of a vLLM attached to with ``--attach`` in
tests/loader/engines/vllm/test_vllm_faults.py, on that module's vLLM; there vLLM itself is read back after each stop.

And what the drain cuts: a stream still running at ``--drain-timeout`` ends with the error a plain request
gets (``replica_stopping``) as an event, then ``[DONE]``; never a broken connection.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from ckptdelta.loader.stopping import HOLD_ENV, PHASES
from tests.replicas import PROMPT, LiveServer, held_after_first_step, lm_dir, run  # noqa: F401
from tests.stops import hotload_until_held, stop_and_check
from tests.loader.test_replica_hygiene import ROOT, _serving_port, short_tmp  # noqa: F401

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
#: make test: the reference engine's two cells (with the vLLM cells and tests/loader/engines/vllm/test_vllm_faults.py's, every signal
#: once, every way a stop ends a hot-load: dropped while preparing, run to its end from the pause on); the rest slow
QUICK = [("prepare", "SIGHUP"), ("pause", "SIGINT")]
FULL = [(p, s) for p in PHASES for s in SIGNALS if (p, s) not in QUICK]


def serve_held(args: list[str], phase: str, tmp: str, log_path: str, env: dict | None = None
               ) -> tuple[subprocess.Popen, str, str]:
    """``ckptdelta serve ARGS --port 0`` whose first hot-load will be held in ``phase``; returns the process,
    its URL and the file the hold creates when the hot-load gets there."""
    marker = os.path.join(os.path.dirname(log_path), f"held-{phase}-{time.monotonic_ns()}")
    env = {**os.environ, "TMPDIR": tmp, HOLD_ENV: f"{phase}:{marker}", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "ckptdelta", "-v", "serve", "--port", "0", *args], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    return proc, f"http://127.0.0.1:{_serving_port(proc, log_path)}", marker


# --- the reference engine ----------------------------------------------------------------------------------

def _reference_cell(run, short_tmp, tmp_path, phase: str, sig: str) -> None:
    log_path = str(tmp_path / "serve.log")
    start, target = run.latest - 1, run.latest
    proc, url, marker = serve_held(["--bucket", run.url, "--snapshot", str(start), "--drain-timeout", "5"], phase,
                                   short_tmp, log_path)
    try:
        job = hotload_until_held(url, target, marker, proc, log_path)
        text = stop_and_check(proc, sig, job, phase, target, log_path)
        serves = start if phase == "prepare" else target
        assert f"the engine serves v{serves:08d}" in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.listdir(short_tmp) == []


@pytest.mark.parametrize("phase,sig", QUICK)
def test_a_reference_replica_stopped_while_preparing_or_in_the_pause_ends_the_hotload_and_exits_0(
        run, short_tmp, tmp_path, phase, sig):
    _reference_cell(run, short_tmp, tmp_path, phase, sig)


@pytest.mark.slow
@pytest.mark.parametrize("phase,sig", FULL)
def test_a_reference_replica_stopped_by_every_signal_in_every_phase_ends_the_hotload(run, short_tmp, tmp_path,
                                                                                     phase, sig):
    _reference_cell(run, short_tmp, tmp_path, phase, sig)


# --- what the drain cuts -----------------------------------------------------------------------------------

def test_a_stream_cut_by_the_drain_timeout_ends_with_the_replica_stopping_error_and_done(run):
    """Two streams still running at a stop's drain timeout: one held between its first and second token, one
    before its first (its 200 and headers sent). Each ends with the error a plain request gets in its 503 as an
    event, then ``[DONE]``; the official client raises it as an APIError, not a connection error."""
    from ckptdelta.loader.engines.reference.model import load_engine
    from ckptdelta.loader.server import create_app, stopping_error

    engine, reader = load_engine(bucket=run.url, snapshot=run.latest)
    server = LiveServer(create_app(engine, reader=reader, replica_id="r-stop"), drain=1.0).__enter__()
    raw: list[str] = []
    outcome: dict = {}
    chat_started = threading.Event()

    def sse() -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                raw.extend(line for line in r.iter_lines() if line)
        except Exception as e:  # noqa: BLE001 - the test says what broke
            outcome["sse"] = e

    def chat() -> None:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            try:
                stream = client.chat.completions.create(model=engine.model_name, stream=True, max_tokens=400,
                                                        messages=[{"role": "user", "content": "hi"}],
                                                        extra_body={"ignore_eos": True})
                chat_started.set()
                outcome["chat"] = f"ended without an error after {len(list(stream))} chunks"
            except Exception as e:  # noqa: BLE001 - which one is the point
                outcome["chat"] = e
            finally:
                chat_started.set()

    first_step, handle = held_after_first_step(engine)
    threads = [threading.Thread(target=sse), threading.Thread(target=chat)]
    try:
        threads[0].start()
        assert first_step.wait(60)
        with engine.hold():                    # both decode loops wait here, past the drain timeout
            threads[1].start()
            assert chat_started.wait(60)
            server.server.handle_exit(signal.SIGTERM, None)    # what uvicorn does on SIGTERM
            for t in threads:
                t.join(60)
    finally:
        handle.remove()
        server.__exit__()
    assert "sse" not in outcome, f"the stream was cut off: {outcome['sse']!r}"
    assert len(raw) == 3 and json.loads(raw[0][len("data: "):])["choices"], raw     # its first token, then:
    assert json.loads(raw[1][len("data: "):]) == stopping_error() and raw[2] == "data: [DONE]", raw
    err = outcome["chat"]
    assert isinstance(err, openai.APIError) and not isinstance(err, openai.APIConnectionError), repr(err)
    assert err.body == stopping_error()["error"], err.body


def test_a_plain_request_cut_by_the_drain_timeout_is_answered_503_then_and_its_decode_stops(run):
    """A plain request still decoding at a stop's drain timeout (its decode held past it) is answered 503
    ``replica_stopping`` then, not when its decode would have ended; and the decode loop stops at its next
    token instead of running on to ``max_tokens`` for nobody."""
    from ckptdelta.loader.engines.reference.model import load_engine
    from ckptdelta.loader.server import create_app, stopping_error

    engine, reader = load_engine(bucket=run.url, snapshot=run.latest)
    server = LiveServer(create_app(engine, reader=reader, replica_id="r-stop"), drain=1.0).__enter__()
    out: dict = {}

    def plain() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            out["answer"] = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})

    first_step, handle = held_after_first_step(engine)
    client = threading.Thread(target=plain)
    try:
        client.start()
        assert first_step.wait(60)
        with engine.hold():                    # the decode loop waits here, past the drain timeout
            server.server.handle_exit(signal.SIGTERM, None)    # what uvicorn does on SIGTERM
            client.join(30)
            assert not client.is_alive(), "the answer waited for the held decode"
        deadline = time.monotonic() + 30
        while engine.generating:               # released: the loop stops at its next token
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        handle.remove()
        server.__exit__()
    answer = out["answer"]
    assert answer.status_code == 503 and answer.json() == stopping_error(), answer.text
    assert engine.stopped_early == 1 and engine.finished == 0
