"""The official ``openai`` client against a real reference replica: completions and chat, streamed and not.

The replica is the real app under uvicorn on 127.0.0.1 over a run the real
Publisher wrote; the client is OpenAI's own Python library, so what is tested is
that an RL user's OpenAI code parses every answer, the streamed ones included
(``engine_data`` in the chunk before ``[DONE]``).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from ckptdelta.loader.engines.reference.model import load_engine
from ckptdelta.loader.server import create_app
from tests.replicas import PROMPT, LiveServer, lm_dir, publish_run  # noqa: F401


@pytest.fixture(scope="module")
def run3(tmp_path_factory, lm_dir):  # noqa: F811
    r = publish_run(str(tmp_path_factory.mktemp("bucket") / "run"), lm_dir, n_versions=3)
    yield r
    r.close()


@pytest.fixture(scope="module")
def replica(run3):
    """One replica for the module, at v1 (tests that hot-load it put it back)."""
    engine, reader = load_engine(bucket=run3.url, snapshot=1)
    with LiveServer(create_app(engine, reader=reader, replica_id="r-stream")) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def client(replica):
    with openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _hotload(url: str, version: int) -> None:
    with httpx.Client(base_url=url, timeout=300) as c:
        job = c.post("/v1/hotload", json={"snapshot": version}).json()
        while job["state"] not in ("READY", "FAILED"):
            time.sleep(0.01)
            job = c.get(f"/v1/hotload/{job['id']}").json()
        assert job["state"] == "READY", job


def _streamed(chunks: list) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str], list]:
    """Per choice: the text (completions ``text`` or chat ``ckptdelta.delta.content``), token ids and finish reason; and
    the chunks without choices (usage, engine_data)."""
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    extra = []
    for ch in chunks:
        if not ch.choices:
            extra.append(ch)
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            text[c.index] = text.get(c.index, "") + piece
            ids.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return text, ids, finish, extra


def test_openai_client_completions_and_chat_streamed_equal_the_plain_answers(client, replica):
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, n=2, logprobs=2,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, n=2, logprobs=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_engine_data": True}))
    text, ids, finish, extra = _streamed(chunks)
    for c in plain.choices:
        assert text[c.index] == c.text and ids[c.index] == c.model_extra["token_ids"] and len(ids[c.index]) == 12
        assert finish[c.index] == "length"
    lps = [lp for ch in chunks for c in ch.choices if c.logprobs for lp in c.logprobs.token_logprobs]
    assert sorted(lps) == sorted(lp for c in plain.choices for lp in c.logprobs.token_logprobs)
    usage, last = extra          # the usage chunk, then the replica's engine_data chunk
    assert usage.usage.completion_tokens == 24 and usage.usage.prompt_tokens == plain.usage.prompt_tokens
    ed = last.model_extra["engine_data"]
    assert ed["policy_versions"] == [1] and ed["snapshot"] == "v00000001" and ed["replica_id"] == "r-stream"
    assert chunks[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    assert len({ch.id for ch in chunks}) == 1

    msgs = [{"role": "user", "content": "what is two plus two?"}]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                           top_logprobs=2, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    text, ids, finish, extra = _streamed(chunks)
    assert text[0] == plain.choices[0].message.content and ids[0] == plain.choices[0].model_extra["token_ids"]
    assert chunks[0].choices[0].delta.role == "assistant" and finish[0] == "length" and not extra
    streamed_lps = [e.logprob for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert streamed_lps == [e.logprob for e in plain.choices[0].logprobs.content]


def test_a_stop_string_is_never_streamed_and_the_text_equals_the_plain_answer(client, replica):
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((full[i:i + 3] for i in range(2, len(full) - 2) if full[i:i + 3].strip()), None)
    assert stop, f"greedy text {full!r} has no usable stop string"
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True}).choices[0]
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                            stream=True, extra_body={"ignore_eos": True}))
    text, ids, finish, _ = _streamed(chunks)
    assert text[0] == plain.text == full[:full.index(stop)] and finish[0] == "stop"
    assert ids[0] == plain.model_extra["token_ids"]
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_a_stream_that_crosses_a_hotload_reports_both_versions(replica, run3):
    """The decode loop is held between its first and second step; the hot-load to v2 runs in that gap."""
    engine = replica.engine
    first_step, chunks = threading.Event(), []

    def hook(module, args, output):
        if not first_step.is_set():
            first_step.set()
            while engine.steps_waiting == 0:
                time.sleep(0.001)

    def stream() -> None:   # a first hot-load may compile kernels on a busy machine: a generous read timeout
        with httpx.Client(base_url=replica.url, timeout=300) as c:
            with c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
                    "stream": True, "return_engine_data": True}) as r:
                chunks.extend(line for line in r.iter_lines() if line)

    handle = engine.model.register_forward_hook(hook)
    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first_step.wait(60)
        with engine.hold():                   # between step 1 and step 2: the swap runs there
            _hotload(replica.url, 2)
    finally:
        t.join(300)
        handle.remove()
    assert chunks[-1] == "data: [DONE]"
    ed = json.loads(chunks[-2][len("data: "):])["engine_data"]
    assert ed["policy_versions"] == [1, 2] and ed["crossed_swap"] is True and ed["prefix_recomputes"] == 1
    _hotload(replica.url, 1)


def test_a_too_old_replica_answers_408_before_the_first_byte_and_unknown_models_404(client, replica):
    model = client.models.list().data[0].id
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"min_policy_version": 2})
    assert info.value.status_code == 408 and info.value.body["type"] == "policy_version_too_old"
    r = httpx.post(replica.url + "/v1/completions", json={"prompt": PROMPT, "stream": True,
                                                          "min_policy_version": 2})
    assert r.status_code == 408 and r.headers["content-type"] == "application/json"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert info.value.body["code"] == "model_not_found" and model in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="someone-else", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:   # re-scored logprobs exist only after the last token
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=1, stream=True,
                                  extra_body={"score_logprobs": True})
    assert "score_logprobs" in info.value.body["message"]


def test_a_client_that_goes_away_ends_the_decode_loop(replica):
    engine = replica.engine
    steps = []
    handle = engine.model.register_forward_hook(lambda *a: steps.append(1))
    try:
        with httpx.Client(base_url=replica.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                                                           "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 30
        seen = -1
        while seen != len(steps):             # until no step has run for a while
            seen = len(steps)
            time.sleep(0.5)
            assert time.monotonic() < deadline
    finally:
        handle.remove()
    assert len(steps) < 400, "the decode loop ran to max_tokens for a client that had gone"
