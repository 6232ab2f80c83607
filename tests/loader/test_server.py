"""The replica server over real HTTP: a tiny real LM, a run published by the real Publisher, uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptdelta.loader.engines.reference.model import Engine, SamplingParams, load_engine
from ckptdelta.loader.hf_model import load_model
from ckptdelta.loader.reader import SnapshotReader
from tests.replicas import (PROMPT, Replica, corrupt_delta, held_after_first_step, lm_dir, publish_run,  # noqa: F401
                            run, start_replica, state_bits_equal)


def fresh_engine(run, version: int, tmp_path) -> Engine:
    """The same version loaded from scratch: materialized from the bucket, loaded by transformers."""
    path = SnapshotReader(run.url).materialize(version, str(tmp_path / f"fresh-{version}"))
    model, tokenizer = load_model(path)
    return Engine(model, tokenizer)


def greedy(engine_or_replica, max_tokens: int = 8) -> tuple[list[int], list[float], list]:
    """Greedy tokens, their logprobs and top-5 alternatives (id, logprob) for PROMPT."""
    if isinstance(engine_or_replica, Engine):
        e = engine_or_replica
        c = e.generate(e.encode(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5,
                                                        ignore_eos=True)).completions[0]
        return c.token_ids, c.logprobs, [[list(p) for p in alts] for alts in c.top_logprobs]
    ch = engine_or_replica.complete(max_tokens=max_tokens, temperature=0, logprobs=5, ignore_eos=True)["choices"][0]
    lp = ch["logprobs"]
    return ch["token_ids"], lp["token_logprobs"], [[[j, v] for j, v in zip(ids, vals)]
                                                   for ids, vals in zip(lp["top_token_ids"], lp["top_token_logprobs"])]


def metric_samples(rep: Replica) -> dict[tuple[str, tuple], float]:
    r = rep.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# --- sampling ---------------------------------------------------------------------------------------

def test_completions_return_text_token_ids_logprobs_and_engine_data(start_replica, run):
    rep = start_replica()
    body = rep.complete(n=3, max_tokens=6, temperature=0.9, seed=7, logprobs=4, ignore_eos=True,
                        return_engine_data=True)
    assert body["object"] == "text_completion" and len(body["choices"]) == 3
    assert body["prompt_token_ids"] == rep.engine.encode(PROMPT)
    for i, ch in enumerate(body["choices"]):
        assert ch["index"] == i and ch["finish_reason"] == "length" and len(ch["token_ids"]) == 6
        lp = ch["logprobs"]
        assert lp["token_ids"] == ch["token_ids"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_token_ids"]) == 6
        assert all(len(alts) == 4 for alts in lp["top_token_ids"])
        for sampled, best in zip(lp["token_logprobs"], lp["top_token_logprobs"]):
            assert sampled <= 0 and best[0] >= sampled and best == sorted(best, reverse=True)
        assert ch["text"] == rep.engine.decode(ch["token_ids"])
    ed = body["engine_data"]
    assert ed["policy_version"] == run.latest and ed["policy_versions"] == [run.latest]
    assert ed["snapshot"] == f"v{run.latest:08d}" and ed["replica_id"] == "r0"
    assert ed["run_id"] == rep.reader.run_id and ed["crossed_swap"] is False
    assert body["usage"] == {"prompt_tokens": len(body["prompt_token_ids"]), "completion_tokens": 18,
                             "total_tokens": len(body["prompt_token_ids"]) + 18}

    # the same seed samples the same tokens; a prompt of token ids is the same prompt
    again = rep.post("/v1/completions", {"prompt": body["prompt_token_ids"], "n": 3, "max_tokens": 6,
                                         "temperature": 0.9, "seed": 7, "logprobs": 4, "ignore_eos": True}).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]
    assert "engine_data" not in again

    # reported logprobs are the model's own: log_softmax of its logits for that prefix
    logits, version = rep.engine.logits(body["prompt_token_ids"])
    first = body["choices"][0]
    assert version == run.latest
    assert first["logprobs"]["token_logprobs"][0] == float(torch.log_softmax(logits, -1)[first["token_ids"][0]])


def test_chat_completions_apply_the_chat_template_with_top_logprobs(start_replica):
    rep = start_replica()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two?"}]
    r = rep.post("/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True,
                                          "top_logprobs": 3, "ignore_eos": True, "return_engine_data": True})
    assert r.status_code == 200, r.text
    body = r.json()
    tok = rep.engine.tokenizer
    expected_prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]
    assert body["object"] == "chat.completion" and body["prompt_token_ids"] == list(expected_prompt)
    ch = body["choices"][0]
    assert ch["message"]["role"] == "assistant" and ch["message"]["content"] == rep.engine.decode(ch["token_ids"])
    content = ch["logprobs"]["content"]
    assert [c["token_id"] for c in content] == ch["token_ids"] and len(content) == 5
    for c in content:
        assert len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["logprob"] == c["logprob"]  # greedy: the top
        assert c["top_logprobs"][0]["token_id"] == c["token_id"] and bytes(c["bytes"]).decode() == c["token"]
    assert body["engine_data"]["policy_version"] == 3

    no_lp = rep.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2}).json()
    assert no_lp["choices"][0]["logprobs"] is None

    tok.chat_template = None  # a tokenizer without a template gets the plain fallback
    plain = rep.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert plain["prompt_token_ids"] == rep.engine.encode("system: be brief\nuser: two plus two?\nassistant:")


def test_greedy_is_deterministic_and_stop_strings_truncate(start_replica):
    rep = start_replica()
    a = rep.complete(max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]
    b = rep.complete(max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]
    assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == "length"
    text = a["text"]
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip()), None)
    assert stop, f"greedy text {text!r} has no usable stop string"
    c = rep.complete(max_tokens=12, temperature=0, ignore_eos=True, stop=["<never>", stop])["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert c["text"] == text[:text.index(stop)]
    assert a["token_ids"][:len(c["token_ids"])] == c["token_ids"] and len(c["token_ids"]) < 12


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1, 2, 999999]}, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 2000, "max_tokens": 400}, "context"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/hotload", {"snapshot": 1.5}, "snapshot"),
    ("/v1/hotload", {}, "snapshot"),
])
def test_bad_requests_are_answered_400_with_the_field_named(start_replica, path, body, needle):
    rep = start_replica()
    r = rep.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"]


def test_malformed_and_oversized_bodies(start_replica):
    rep = start_replica()
    r = rep.http.post("/v1/completions", content=b'{"prompt": "x", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = rep.post("/v1/completions", {"prompt": "a" * (1 << 20)})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for _ in range(40):
            yield b"a" * 65536

    r = rep.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert rep.complete(max_tokens=1)["choices"]  # still serving


# --- hot-loads -----------------------------------------------------------------------------------------

def test_a_hotload_job_reports_its_timings_and_the_replica_answers_as_a_fresh_load_of_the_snapshot(start_replica, run,
                                                                                                 tmp_path):
    """Forward, back and across an anchor, bit for bit, and a failed apply rolled back: the engine contract
    (tests/loader/engines/reference/test_conformance.py). Here: what the job and status report of a hot-load,
    and greedy answers equal to a model loaded from scratch."""
    rep = start_replica(0)
    assert rep.status()["policy_version"] == 0
    accepted = rep.post("/v1/hotload", {"snapshot": "latest"})
    assert accepted.status_code == 202 and accepted.json()["target_version"] == 3
    job = rep.wait(accepted.json()["id"])
    assert job["state"] == "READY", job
    report = job["report"]
    assert report["from_version"] == 0 and report["to_version"] == 3 and report["via_anchor"] is False
    assert report["bytes_fetched"] > 0 and set(job["timings"]) == {"fetch_s", "decode_s", "apply_s", "pause_s",
                                                                   "total_s", "prepare_s"}
    assert all(v >= 0 for v in job["timings"].values())
    assert state_bits_equal(rep.engine.model, run.truth[3]) == []
    assert greedy(rep) == greedy(fresh_engine(run, 3, tmp_path))

    status = rep.status()
    assert status["policy_version"] == 3 and status["snapshot"] == "v00000003" and status["state"] == "READY"
    assert status["last_hotload"]["id"] == job["id"] and status["run_id"] == rep.reader.run_id


def test_hotloads_under_concurrent_requests_fail_none_and_versions_never_go_back(start_replica, run):
    rep = start_replica(0)
    stop = threading.Event()
    seen: dict[int, list[list[int]]] = {i: [] for i in range(3)}
    errors: list[str] = []

    def sampler(i: int) -> None:
        with httpx.Client(base_url=rep.url, timeout=60) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"prompt": PROMPT, "n": 1 + i % 2, "max_tokens": 6,
                                                       "temperature": 1.0, "ignore_eos": True,
                                                       "return_engine_data": True})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text}")
                    return
                seen[i].append(r.json()["engine_data"]["policy_versions"])

    threads = [threading.Thread(target=sampler, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for v in (1, 2, 3):
            while min(len(s) for s in seen.values()) < 2 * v and not errors:  # requests before every swap
                time.sleep(0.005)
            assert rep.hotload(v)["state"] == "READY"
        counts = {i: len(s) for i, s in seen.items()}
        while any(len(seen[i]) < counts[i] + 2 for i in seen) and not errors:  # and after the last
            time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == []
    for versions in seen.values():
        flat = [v for req in versions for v in req]
        assert flat == sorted(flat), versions  # each client's view only moves forward
        assert versions[-1] == [3]
    assert {v for s in seen.values() for req in s for v in req} >= {0, 3}


def test_corrupt_delta_object_fails_the_hotload_and_keeps_serving_the_old_weights(start_replica, lm_dir, tmp_path):
    run = publish_run(str(tmp_path / "bucket" / "run"), lm_dir, n_versions=3)
    try:
        rep = start_replica(1, bucket=run.url)
        corrupt_delta(run, 2)

        job = rep.hotload(2)
        assert job["state"] == "FAILED" and job["reason"] and job["error_type"], job
        assert "v00000002" in job["reason"] or "deltas/" in job["reason"], job["reason"]
        status = rep.status()
        assert status["policy_version"] == 1 and status["last_hotload"]["state"] == "FAILED"
        assert state_bits_equal(rep.engine.model, run.truth[1]) == []
        assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_version"] == 1
        m = metric_samples(rep)
        assert m[("ckptdelta_hotloads_total", (("result", "failed"),))] == 1
        assert m[("ckptdelta_policy_version", ())] == 1
        assert rep.hotload(0)["state"] == "READY"  # the replica still hot-loads what is intact
        assert state_bits_equal(rep.engine.model, run.truth[0]) == []
    finally:
        run.close()


def test_one_hotload_at_a_time_join_conflict_and_idempotent_repeat(start_replica):
    rep = start_replica(1)
    with rep.engine.step():  # a forward step that does not end: the swap must wait for it
        first = rep.post("/v1/hotload", {"snapshot": 2})
        assert first.status_code == 202 and first.json()["state"] in ("PREPARING", "SWAPPING")
        job_id = first.json()["id"]
        assert rep.wait(job_id, states=("SWAPPING",))["state"] == "SWAPPING"
        for same in (2, "v00000002", "2"):
            joined = rep.post("/v1/hotload", {"snapshot": same})
            assert joined.status_code == 202 and joined.json()["id"] == job_id and joined.json()["joined"] is True
        other = rep.post("/v1/hotload", {"snapshot": 3})
        assert other.status_code == 409
        err = other.json()["error"]
        assert err["type"] == "hotload_in_progress" and err["running"]["id"] == job_id
        assert rep.status()["state"] == "SWAPPING" and rep.status()["policy_version"] == 1
    assert rep.wait(job_id)["state"] == "READY"
    again = rep.post("/v1/hotload", {"snapshot": 2})
    assert again.status_code == 200 and again.json()["id"] == job_id and again.json()["state"] == "READY"
    m = metric_samples(rep)
    assert m[("ckptdelta_hotloads_total", (("result", "ready"),))] == 1
    assert m.get(("ckptdelta_hotloads_total", (("result", "noop"),)), 0) == 0  # the repeat did no work
    nxt = rep.post("/v1/hotload", {"snapshot": "latest"})
    assert nxt.status_code == 202 and nxt.json()["id"] != job_id and rep.wait(nxt.json()["id"])["state"] == "READY"


def test_a_hotloads_state_asked_with_wait_is_answered_once_the_job_ends_or_the_wait_runs_out(start_replica):
    """``GET /v1/hotload/{id}?wait=S``: a job still held answers its busy state once S runs out; one asked while
    held and released meanwhile answers READY in its one answer (the clients wait this way, not by polling)."""
    from concurrent.futures import ThreadPoolExecutor

    rep = start_replica(1)
    with ThreadPoolExecutor(1) as pool:
        with rep.engine.step():  # a forward step that does not end: the swap waits for it
            job_id = rep.post("/v1/hotload", {"snapshot": 2}).json()["id"]
            assert rep.wait(job_id, states=("SWAPPING",))["state"] == "SWAPPING"
            held = rep.http.get(f"/v1/hotload/{job_id}?wait=0.05")
            assert held.status_code == 200 and held.json()["state"] == "SWAPPING"
            answer = pool.submit(rep.http.get, f"/v1/hotload/{job_id}?wait=30")
            time.sleep(0.2)      # the long poll in flight before the step ends (were it not, READY all the same)
        assert answer.result().json()["state"] == "READY"
    for bad in (-1, 31, "soon"):
        r = rep.http.get(f"/v1/hotload/{job_id}?wait={bad}")
        assert r.status_code in (400, 422) and "wait" in r.text, r.text


def test_a_hotload_posted_with_wait_answers_its_end_in_the_one_request(start_replica):
    """``POST /v1/hotload`` with ``wait``: a job held past the wait answers 202 with its busy state; one that
    ends within it answers 200 READY, the new version serving, with no second request; a bad wait is a 400
    that starts nothing."""
    rep = start_replica(1)
    for bad in (-1, 31):
        r = rep.post("/v1/hotload", {"snapshot": 2, "wait": bad})
        assert r.status_code == 400 and "wait" in r.text, r.text
    assert rep.status()["last_hotload"] is None and rep.status()["hotload"] is None
    with rep.engine.step():     # a forward step that does not end: the swap waits for it
        held = rep.post("/v1/hotload", {"snapshot": 2, "wait": 0.1})
        assert held.status_code == 202 and held.json()["state"] in ("PREPARING", "SWAPPING"), held.text
    assert rep.wait(held.json()["id"])["state"] == "READY"
    r = rep.post("/v1/hotload", {"snapshot": 3, "wait": 30})
    assert r.status_code == 200 and r.json()["state"] == "READY" and r.json()["target_version"] == 3, r.text
    assert rep.status()["policy_version"] == 3
    # what a replica that does not know the field answers (a 400 naming it, nothing started) is told from other
    # refusals: the clients then ask again without it
    from ckptdelta.loader.fleet import wait_refused

    assert wait_refused(rep.post("/v1/hotload", {"snapshot": 2, "wait": "soon"}))
    assert not wait_refused(rep.post("/v1/hotload", {"snapshot": "../x", "wait": 1}))
    assert not wait_refused(rep.post("/v1/hotload", {"snapshot": 2, "await_commit_s": "soon"}))
    assert rep.status()["policy_version"] == 3 and rep.status()["hotload"] is None


def test_unknown_or_unsafe_snapshots_are_refused_without_leaving_the_run(start_replica, run, tmp_path):
    rep = start_replica(1)
    for missing in (99, "v00000099", "99"):
        r = rep.post("/v1/hotload", {"snapshot": missing})
        assert r.status_code == 404 and r.json()["error"]["type"] == "snapshot_not_found", r.text
        assert "99" in r.json()["error"]["message"]
    for unsafe in ("../run", "../../etc/passwd", "/etc/passwd", "a/b", "..", "v1/../v2", "", "latest/.."):
        r = rep.post("/v1/hotload", {"snapshot": unsafe})
        assert r.status_code in (400, 404), (unsafe, r.text)
    r = rep.post("/v1/hotload", {"snapshot": -1})
    assert r.status_code == 400
    assert rep.http.get("/v1/hotload/hl-nope").status_code == 404
    assert rep.status()["policy_version"] == 1 and rep.status()["last_hotload"] is None


def test_start_from_hf_directory_then_first_hotload_goes_through_an_anchor(start_replica, run, lm_dir):
    rep = start_replica(model_dir=lm_dir)
    assert rep.status()["policy_version"] is None
    r = rep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "min_policy_version": 0})
    assert r.status_code == 408 and r.json()["error"]["policy_version"] is None
    job = rep.hotload(2)
    assert job["state"] == "READY" and job["report"]["via_anchor"] is True and job["from_version"] is None
    assert state_bits_equal(rep.engine.model, run.truth[2]) == []
    assert rep.status()["policy_version"] == 2


def test_a_replica_started_from_a_model_directory_before_the_first_publish_serves_then_hot_loads_the_run(
        start_replica, lm_dir, tmp_path, monkeypatch):
    """`serve --model DIR --bucket URL` may start before the trainer's first publish creates the run: it serves
    the directory's weights (version unknown), and once the run exists it hot-loads it and names its run id."""
    import ckptdelta.loader.server as server

    monkeypatch.setattr(server, "RUN_LOOK_S", 0.0)
    bucket = str(tmp_path / "not-yet")
    rep = start_replica(bucket=bucket, model_dir=lm_dir)
    st = rep.status()
    assert (st["policy_version"], st["run_id"]) == (None, None)
    assert rep.complete(max_tokens=1)["choices"]
    r = rep.post("/v1/hotload", {"snapshot": "latest"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "snapshot_not_found"
    run = publish_run(bucket, lm_dir, n_versions=2)
    job = rep.hotload(1)
    assert job["state"] == "READY" and job["report"]["via_anchor"] is True
    assert state_bits_equal(rep.engine.model, run.truth[1]) == []
    assert rep.status()["run_id"] == run.publisher.run_id
    body = rep.complete(max_tokens=1, return_engine_data=True)
    assert body["engine_data"]["run_id"] == run.publisher.run_id
    run.publisher.close()


def test_a_snapshot_gc_deleted_or_of_a_deleted_run_is_404_not_a_failed_hotload(start_replica, lm_dir, tmp_path):
    """Regression (issue 15, item 8): manifests cached by the replica outlived their snapshots. After gc
    removed v0-v3, a hot-load of v2 was accepted (202) and FAILED on a missing anchor; after the run was
    deleted and published again (a new run id), hot-loads FAILED with ObjectNotFoundError or a
    ShapeMismatchError taken from the deleted run's manifests. Both are 404 snapshot_not_found now."""
    import shutil

    from ckptdelta.publisher import Publisher, collect
    from tests.lm import hf_extra_files, rl_step

    url = str(tmp_path / "bucket" / "run")
    weights = load_model(lm_dir)[0].state_dict()
    with Publisher(url, anchor_every=2, extra_files=hf_extra_files(lm_dir), progress=False) as pub:
        for step in range(6):                     # anchors 0, 2, 4; deltas 1, 3, 5
            pub.publish(weights, step)
            weights = rl_step(weights, seed=step)
    rep = start_replica(3, bucket=url)            # its reader holds the manifests of v2 and v3
    assert collect(url, keep_anchors=1, grace_seconds=0).deleted_versions == (0, 1, 2, 3)
    r = rep.post("/v1/hotload", {"snapshot": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "snapshot_not_found", r.text
    assert "v00000002" in r.json()["error"]["message"] and "deleted" in r.json()["error"]["message"]
    assert rep.hotload(5)["state"] == "READY"     # what gc kept still loads

    shutil.rmtree(url)                            # the run deleted, then published again: another run id
    with Publisher(url, extra_files=hf_extra_files(lm_dir), progress=False) as pub:
        for step in range(4):
            pub.publish({k: v.float() if k.endswith("norm.weight") else v for k, v in weights.items()}, step)
    for snapshot in (0, 3, "latest"):
        r = rep.post("/v1/hotload", {"snapshot": snapshot})
        assert r.status_code == 404 and r.json()["error"]["type"] == "snapshot_not_found", (snapshot, r.text)
        assert "no longer exist" in r.json()["error"]["message"]
    assert rep.status()["policy_version"] == 5 and rep.status()["last_hotload"]["state"] == "READY"
    rep.complete(max_tokens=2)


def test_a_hotload_whose_thread_cannot_start_fails_saying_why_and_the_next_one_runs(start_replica, monkeypatch):
    """No thread to be had for a hot-load (the host's thread limit): the job must end FAILED with the reason and
    the request get a JSON 503, not stay the running job for good (every other hot-load 409, a wait that never
    returns, a queued one that never starts)."""
    rep = start_replica(1)
    manager = rep.server.server.config.app.state.hotloads
    real = manager._runner.submit
    failures = iter([RuntimeError("can't start new thread")])

    def submit_once_failing(*args, **kwargs):     # the one fault: Thread.start() refusing, as at the limit
        for e in failures:
            raise e
        return real(*args, **kwargs)

    monkeypatch.setattr(manager._runner, "submit", submit_once_failing)
    r = rep.post("/v1/hotload", {"snapshot": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "hotload_not_started"
    assert "could not start (RuntimeError: can't start new thread); still serving v00000001" in \
        r.json()["error"]["message"]
    st = rep.status()
    assert st["hotload"] is None and st["last_hotload"]["state"] == "FAILED"
    assert st["last_hotload"]["error_type"] == "RuntimeError"
    assert rep.hotload(2)["state"] == "READY"          # the next one starts and lands
    assert rep.status()["policy_version"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_messages_the_chat_template_refuses_are_a_400_naming_why_and_an_engine_failure_a_json_500(
        start_replica, monkeypatch, stream):
    """Templates refuse messages they cannot render (raise_exception on a system role, roles that do not
    alternate): that is the request's fault, a 400 saying what the template said. Any other failure of the engine
    is a 500 a client can show, OpenAI-shaped, not a bare text/plain "Internal Server Error"."""
    rep = start_replica(1)
    tok = rep.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}",
                        raising=False)
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 1, "stream": stream}
    r = rep.post("/v1/chat/completions", body)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"] == {"type": "invalid_request_error",
                                 "message": "messages: the model's chat template refused them: System role not "
                                            "supported"}
    assert rep.post("/v1/chat/completions", {**body, "messages": body["messages"][1:]}).status_code == 200

    def broken(*args, **kwargs):                      # the one fault: the engine's tokenizer failing
        raise RuntimeError("tokenizer state lost")

    monkeypatch.setattr(rep.engine, "encode", broken)
    r = rep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "stream": stream})
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "engine_error"
    assert "failed on this request: RuntimeError: tokenizer state lost" in r.json()["error"]["message"]


def test_min_policy_version_above_the_served_one_is_408(start_replica):
    rep = start_replica(1)
    r = rep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "min_policy_version": 2})
    assert r.status_code == 408
    assert r.json() == {"error": {"type": "policy_version_too_old", "message": r.json()["error"]["message"],
                                  "policy_version": 1, "min_policy_version": 2}}
    r = rep.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                          "min_policy_version": 2})
    assert r.status_code == 408
    assert rep.complete(max_tokens=1, min_policy_version=1)["choices"]


# --- what a request in flight sees at a swap -----------------------------------------------------------

def _across_a_swap(engine: Engine, request, swap):
    """Run ``request()`` so that its first step uses the old weights and every later step the new ones.

    A forward hook holds step 1 open until the test has queued behind it on the
    engine's FIFO step lock; the test then owns the gap between step 1 and step 2
    and runs ``swap()`` in it."""
    first_step, handle = held_after_first_step(engine)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("result", request()))
    t.start()
    try:
        assert first_step.wait(60)
        with engine.hold():  # between step 1 and step 2
            swap()
    finally:
        t.join(60)
        handle.remove()
    return out["result"]


def _generate_across_a_swap(engine: Engine, target: int, prompt: list[int], params: SamplingParams):
    return _across_a_swap(engine, lambda: engine.generate(prompt, params), lambda: engine.swapper.hotload(target))


def test_a_request_in_flight_crosses_a_hotload_and_reports_the_span(start_replica):
    rep = start_replica(1)
    with httpx.Client(base_url=rep.url, timeout=60) as other:
        body = _across_a_swap(
            rep.engine,
            lambda: other.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 2, "ignore_eos": True,
                                                        "return_engine_data": True}),
            lambda: rep.hotload(2))  # over HTTP, to READY, while the request waits between two steps
    assert body.status_code == 200, body.text
    ed = body.json()["engine_data"]
    assert ed["policy_versions"] == [1, 2] and ed["policy_version"] == 2 and ed["crossed_swap"] is True
    assert ed["prefix_recomputes"] == 1 and all(len(c["token_ids"]) == 5 for c in body.json()["choices"])
    m = metric_samples(rep)
    assert m[("ckptdelta_requests_crossed_swap_total", ())] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_rollback_while_a_request_runs_makes_its_answer_a_408_not_a_version_below_its_floor(start_replica, stream):
    """min_policy_version is checked at the request's start, and again on the versions that served it: a hot-load
    to an older version landing while it runs would otherwise answer with tokens of a policy below the floor."""
    rep = start_replica(2)
    with httpx.Client(base_url=rep.url, timeout=60) as other:
        body = _across_a_swap(
            rep.engine,
            lambda: other.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
                                                        "min_policy_version": 2, "return_engine_data": True,
                                                        "stream": stream}),
            lambda: rep.hotload(1))          # a rollback, between the request's first step and its second
    if not stream:
        assert body.status_code == 408 and body.headers["retry-after"] == "1"
        err = body.json()["error"]
    else:                                    # the 200 went out with the first byte: an error event, then [DONE]
        assert body.status_code == 200
        events = [line[len("data: "):] for line in body.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
    assert (err["type"], err["policy_version"], err["min_policy_version"]) == ("policy_version_too_old", 1, 2)
    assert "served this request with policy versions [2, 1], below the 2 it needs" in err["message"]
    assert rep.complete(max_tokens=1, min_policy_version=1)["choices"]


def test_recompute_policy_reruns_the_prefix_with_the_new_weights(run, tmp_path):
    engine, _ = load_engine(bucket=run.url, snapshot=1, cache_policy="recompute")
    prompt = engine.encode(PROMPT)
    gen = _generate_across_a_swap(engine, 3, prompt,
                                  SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True))
    assert gen.policy_versions == [1, 3] and gen.recomputes == 1 and gen.stale_kv_steps == 0
    toks, lps = gen.completions[0].token_ids, gen.completions[0].logprobs
    old, new = fresh_engine(run, 1, tmp_path), fresh_engine(run, 3, tmp_path)
    # token 0 came from v1; token 1 from v3 over a prefix recomputed by v3, exactly as a fresh v3 computes it
    assert lps[0] == float(torch.log_softmax(old.logits(prompt)[0], -1)[toks[0]])
    assert lps[1] == float(torch.log_softmax(new.logits(prompt + toks[:1])[0], -1)[toks[1]])


def test_keep_policy_continues_on_stale_kv_and_says_so(run):
    engine, _ = load_engine(bucket=run.url, snapshot=1, cache_policy="keep")
    gen = _generate_across_a_swap(engine, 2, engine.encode(PROMPT),
                                  SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert gen.policy_versions == [1, 2] and gen.recomputes == 0 and gen.stale_kv_steps == 3


# --- auth and metrics -------------------------------------------------------------------------------------

def test_api_key_is_required_on_every_endpoint(start_replica):
    rep = start_replica(1, api_key="s3cret-key")
    endpoints = [("GET", "/v1/status", None), ("GET", "/metrics", None), ("GET", "/health", None),
                 ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                 ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                 ("POST", "/v1/hotload", {"snapshot": 2}), ("GET", "/v1/hotload/anything", None)]
    with httpx.Client(base_url=rep.url, timeout=30) as anon:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                        {"Authorization": "Bearer s3cret-ke"},
                        {"Authorization": "Bearer s3cret-key2"}):
            for method, path, body in endpoints:
                r = anon.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path, r.text)
                assert r.json()["error"]["type"] == "unauthorized"
    assert rep.status()["policy_version"] == 1 and rep.status()["last_hotload"] is None  # nothing ran
    assert rep.complete(max_tokens=1)["choices"]
    assert rep.http.get("/health", headers={"Authorization": "bearer s3cret-key"}).status_code == 200
    m = metric_samples(rep)
    assert m[("ckptdelta_requests_total", (("endpoint", "/v1/hotload"), ("status", "401")))] == 5


def test_metrics_record_versions_pause_bytes_and_requests(start_replica):
    rep = start_replica(0)
    rep.complete(max_tokens=2)
    job = rep.hotload(2)
    assert job["state"] == "READY"
    m = metric_samples(rep)
    assert m[("ckptdelta_policy_version", ())] == 2
    assert m[("ckptdelta_hotload_pause_seconds_count", ())] == 1
    assert m[("ckptdelta_hotload_pause_seconds_sum", ())] == job["report"]["pause_s"]
    assert m[("ckptdelta_hotload_duration_seconds_count", ())] == 1
    assert m[("ckptdelta_hotload_bytes_fetched_total", ())] == job["report"]["bytes_fetched"] > 0
    assert m[("ckptdelta_hotloads_total", (("result", "ready"),))] == 1
    assert m[("ckptdelta_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert m[("ckptdelta_requests_total", (("endpoint", "/v1/hotload"), ("status", "202")))] == 1
    assert m[("ckptdelta_generated_tokens_total", ())] == 2
    # every family has HELP and TYPE lines: the text parses as Prometheus exposition format
    text = rep.http.get("/metrics").text
    assert "# TYPE ckptdelta_hotload_pause_seconds histogram" in text
    assert rep.status()["last_hotload"]["report"]["pause_s"] == job["report"]["pause_s"]
