"""What a stop's drain cuts: a stream still running at ``--drain-timeout`` ends with the error a plain request
gets (``replica_stopping``) as an event, then ``[DONE]``; never a broken connection.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai

from tests.replicas import PROMPT, LiveServer, lm_dir, run  # noqa: F401


def test_a_stream_cut_by_the_drain_timeout_ends_with_the_replica_stopping_error_and_done(run):
    """Two streams still running at a stop's drain timeout: one held between its first and second token, one
    before its first (its 200 and headers sent). Each ends with the error a plain request gets in its 503 as an
    event, then ``[DONE]``; the official client raises it as an APIError, not a connection error."""
    from loader.engine import build_engine
    from loader.server import create_app, stopping_error

    engine, reader = build_engine(bucket=run.url, snapshot=run.latest)
    server = LiveServer(create_app(engine, reader=reader, replica_id="r-stop"), drain=1.0).__enter__()
    raw: list[str] = []
    outcome: dict = {}
    first_step, chat_started = threading.Event(), threading.Event()

    def hold_after_first_step(module, args, output):     # the first step ends once the test holds the next
        if not first_step.is_set():
            first_step.set()
            while engine.steps_waiting == 0:
                time.sleep(0.001)

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

    handle = engine.model.register_forward_hook(hold_after_first_step)
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
