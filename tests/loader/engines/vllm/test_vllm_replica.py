"""A real vLLM server as a replica: hot-loads prepared while it serves, swapped in a keep-mode pause, bit-exact.

Every test here talks to vLLM's CPU build over HTTP (nothing of vLLM is mocked):
the replica app forwards sampling bodies to vLLM's own OpenAI server and moves
its weights through vLLM's reload path; exactness is checked by reading every
runtime parameter back inside vLLM's worker (through the layer's own kernel
where vLLM has re-packed it) and comparing bits with what was published.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import torch

from ckptdelta.loader.reader import SnapshotReader
from tests.lm import rl_step
from tests.loader.engines.conformance import EngineContract
from tests.servers import free_port
from tests.vllm_models import save_tiny_llama, save_tiny_moe
from tests.vllm_replicas import (PROMPT, VLLM_ARGS, VllmReplicaHandle, bit_diff, publish_vllm_run,
                                 start_vllm_replica, one_gpu_layout, vllm_generations)


pytestmark = pytest.mark.usefixtures("one_gpu_layout")   # (imported) every vLLM here: its worker in the engine core


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-llama")
    run = publish_vllm_run(str(root / "bucket" / "run"), save_tiny_llama(str(root / "model")), deltas=2)
    yield run
    run.publisher.close()


@pytest.fixture(scope="module")
def rep(llama_run, tmp_path_factory):
    r = start_vllm_replica(llama_run, 0, cache_dir=str(tmp_path_factory.mktemp("vllm-cache")))
    yield r
    r.close()


def _special_values(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step whose changed elements include a NaN with a payload, -0.0 and a subnormal (bf16), in tensors
    vLLM keeps as plain parameters; the NaN sits in the embedding row of a token no prompt here uses."""
    new = {k: v.clone() for k, v in weights.items()}
    emb = new["model.embed_tokens.weight"].view(torch.int16)
    emb[5, 0] = 0x7FC5                                             # a quiet NaN with payload 0x45
    emb[5, 1] = -0x8000                                            # -0.0
    emb[5, 2] = 0x0003                                             # a subnormal
    norm = new["model.norm.weight"].view(torch.int16)
    norm[3] = -0x8000
    norm[4] = 0x0001
    q = new["model.layers.0.self_attn.q_proj.weight"].view(torch.int16)  # a linear vLLM re-packs on CPU
    q[0, 0] = -0x8000
    q[0, 1] = 0x0002
    return new


def _kernel_diff(rep: VllmReplicaHandle, truth: dict[str, torch.Tensor], tmp_dir: str) -> list[str]:
    """bit_diff, with tensors the worker read through a GEMM kernel compared as that kernel sees them."""
    from ckptdelta.loader.engines.vllm.proof import kernel_view

    live = rep.live_weights(tmp_dir, strict=False)
    view = {n: kernel_view(t) if n in rep.kernel_read else t for n, t in truth.items()}
    return bit_diff({n: kernel_view(t) if n in rep.kernel_read else t for n, t in live.items()}, view)


def _weight_version(rep: VllmReplicaHandle) -> str:
    from ckptdelta.loader.engines.vllm.control import http_client

    with http_client(rep.engine.url, timeout=30) as c:
        return c.get("/weight_info").json()["weight_version"]


def test_serves_the_snapshot_with_vllms_own_options_and_engine_data(rep, llama_run):
    body = rep.complete(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1, return_token_ids=True,
                        return_engine_data=True)
    choice = body["choices"][0]
    assert len(choice["logprobs"]["top_logprobs"]) == len(choice["logprobs"]["tokens"]) > 0
    assert choice["prompt_logprobs"] and choice["token_ids"]
    ed = body["engine_data"]
    assert ed["policy_version"] == rep.engine.version == 0 and ed["snapshot"] == "v00000000"
    assert ed["replica_id"] == "vllm-0" and ed["policy_versions"] == [0] and not ed["crossed_swap"]
    ids = rep.post("/v1/completions", {"prompt": choice["token_ids"][:2] + [3, 4], "max_tokens": 2,
                                       "return_token_ids": True})  # a prompt of token ids
    assert ids.status_code == 200 and ids.json()["choices"][0]["prompt_token_ids"] == choice["token_ids"][:2] + [3, 4]
    two = rep.complete(max_tokens=6, temperature=1.0, n=2, seed=7)
    assert len(two["choices"]) == 2
    assert rep.complete(max_tokens=6, temperature=1.0, n=2, seed=7)["choices"] == two["choices"]  # seeded
    chat = rep.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                                             "return_engine_data": True, "logprobs": True, "top_logprobs": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["engine_data"]["policy_version"] == 0 and chat.json()["choices"][0]["logprobs"]["content"]
    st = rep.http.get("/v1/status").json()
    assert st["policy_version"] == 0 and st["state"] == "READY" and st["engine"]["kind"] == "vllm"
    assert _weight_version(rep) == "0"
    bad = rep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": -3})
    assert bad.status_code == 400  # vLLM's own validation, passed through


def test_the_loops_shaped_sampling_client_gets_tokens_logprobs_and_prompt_logprobs_from_vllm(rep, llama_run):
    """Issue 41, item 3, on vLLM: the client asks vLLM for what the reference engine always sends (token ids with
    return_token_ids, the sampled tokens' logprobs with logprobs=0, prompt_logprobs) and reads it in one shape:
    one logprob per token, the prompt's own logprob at each position, stop_reason from vLLM's finish_reason."""
    import asyncio
    import json
    import math

    from ckptdelta.loader.sampling import ModelInput, SamplingClient, SamplingParams

    with open(os.path.join(llama_run.model_dir, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    v = rep.engine.version
    ids = rep.complete(max_tokens=1, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    prompt = ModelInput.from_ints(ids)
    with SamplingClient(rep.url, min_policy_version=v, ready_timeout=120) as client:
        resp = client.sample(prompt, num_samples=2, sampling_params=SamplingParams(max_tokens=5, seed=3),
                             include_prompt_logprobs=True, topk_prompt_logprobs=2)
        assert resp.policy_version == v and resp.policy_versions == [v] and len(resp.sequences) == 2
        for seq in resp.sequences:
            assert 0 < len(seq.tokens) == len(seq.logprobs) <= 5
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in seq.logprobs)
            assert seq.stop_reason == ("stop" if seq.tokens[-1] == eos else "length")
        assert len(resp.prompt_logprobs) == len(ids) and resp.prompt_logprobs[0] is None
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in resp.prompt_logprobs[1:])
        for own, top in zip(resp.prompt_logprobs[1:], resp.topk_prompt_logprobs[1:]):
            assert len(top) == 2 and top[0][1] >= top[1][1]
            assert own in (lp for _, lp in top) or own <= top[1][1] + 1e-6
        assert resp.prompt_logprobs_version == v          # one version served while it ran: its prefill's

        greedy = client.sample(prompt, sampling_params=SamplingParams(max_tokens=5, temperature=0.0)).sequences[0]
        top1 = client.sample(prompt, sampling_params=SamplingParams(max_tokens=5, top_k=1, seed=9)).sequences[0]
        assert top1.tokens == greedy.tokens                  # top_k reaches vLLM: 1 is the argmax
        stop = greedy.tokens[1]
        stopped = client.sample(prompt, sampling_params=SamplingParams(max_tokens=5, temperature=0.0,
                                                                       stop=[stop])).sequences[0]
        assert stopped.tokens == greedy.tokens[:greedy.tokens.index(stop) + 1] and stopped.stop_reason == "stop"
        # the sequence scored as a prompt: each sampled token's logprob again, at its own position (vLLM's prefill
        # rounds differently from its decode: close, not equal)
        scored = client.compute_logprobs(ModelInput.from_ints(ids + greedy.tokens))
        assert len(scored) == len(ids) + len(greedy.tokens) and scored.policy_version == v
        assert max(abs(a - b) for a, b in zip(scored[len(ids):], greedy.logprobs)) < 0.1

        async def group() -> list:
            return await asyncio.gather(*(client.sample_async(prompt, sampling_params=SamplingParams(max_tokens=3))
                                          for _ in range(3)))
        assert [r.policy_versions for r in asyncio.run(group())] == [[v]] * 3


def test_special_values_reloaded_in_the_pause_a_shadow_after_a_reload_and_in_place_patches_are_bit_exact(
        rep, llama_run, tmp_path):
    """vLLM's own ways of applying a hot-load, each bit-exact in every runtime parameter: norms and the embedding
    patched in place (1), a reload inside the pause of a step with NaN payloads, -0.0 and subnormals (4, past an
    anchor), and a shadow built right after that reload (0). Forward, back and across an anchor on their own: the
    engine contract (TestVllmEngine below)."""
    if 3 not in llama_run.truth:
        llama_run.publish(llama_run.truth[2], anchor=True)
    if 4 not in llama_run.truth:
        llama_run.publish(_special_values(llama_run.truth[3]))
    for target in (1, 4, 0):
        # 4: re-packed inside the pause (--apply reload); a live reload leaves vLLM's loader wrappers on its
        # metadata, which the next shadow (0) must not follow back into the live modules
        rep.engine.applier.shadows = target != 4
        job = rep.hotload(target)
        assert job["state"] == "READY", job
        assert rep.engine.version == target and rep.http.get("/v1/status").json()["policy_version"] == target
        if target == 4:  # -0.0 and a subnormal in q_proj: exact everywhere but where no GEMM can tell
            assert _kernel_diff(rep, llama_run.truth[4], str(tmp_path)) == []
            live = rep.live_weights(str(tmp_path), strict=False)
            plain = [n for n in live if n not in rep.kernel_read]
            assert "model.embed_tokens.weight" in plain and "model.norm.weight" in plain
            assert bit_diff({n: live[n] for n in plain}, {n: llama_run.truth[4][n] for n in plain}) == []
        else:
            assert bit_diff(rep.live_weights(str(tmp_path)), llama_run.truth[target]) == [], target
        assert _weight_version(rep) == str(target)
        assert job["report"]["pause_s"] > 0 and job["report"]["via_anchor"] == (target in (4, 0))
        last = rep.http.get("/v1/status").json()["engine"]["last_swap"]
        assert last["verified"] and last["version"] == target
        assert last["apply"] == ("reload" if target == 4 else "shadow"), last  # else re-packed while serving
        if target == 1:  # norms and the (untied) embedding are written in place, element by element
            assert last["patched_tensors"] >= 5 and 0 < last["patched_elements"] < 20_000
    assert rep.complete(max_tokens=3, return_engine_data=True)["engine_data"]["policy_version"] == 0
    rep.engine.applier.shadows = True
    # every shadow was released with its packed weights (vLLM's reload records would keep them alive), and
    # the worker maps no shared file but the host copy, the only one of this replica in shared memory
    mem = rep.engine.applier.control.rpc("ckptdelta_memory", {})[0]
    assert mem["stray_modules"] == 0 and mem["shadow"] is None and mem["mapped_files"] <= 1, mem
    from ckptdelta.loader.engines.shared_weights import default_dir
    mine = [f for f in os.listdir(default_dir()) if f.startswith("ckptdelta-") and f"-{os.getpid()}-" in f]
    assert mine and all(f.startswith(f"ckptdelta-weights-{os.getpid()}-") for f in mine), mine


@pytest.mark.slow     # its own vLLM start (~30-60 s); make test proves every live weight bit for bit instead
def test_greedy_tokens_and_logprobs_equal_a_fresh_vllm_server_on_the_same_snapshot(rep, llama_run, tmp_path):
    from ckptdelta.loader.engines.vllm.server import VllmServer
    from ckptdelta.loader.engines.vllm.control import http_client
    from ckptdelta.loader.reader import SnapshotReader

    assert rep.hotload(1)["state"] == "READY"
    assert rep.hotload(2)["state"] == "READY"
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    hot = rep.complete(**body)["choices"][0]
    model_dir = SnapshotReader(llama_run.url).materialize(2, str(tmp_path / "v2"))
    fresh = VllmServer(model_dir, served_name=rep.engine.model_name, args=VLLM_ARGS)
    try:
        fresh.wait_ready()
        with http_client(fresh.url, timeout=120) as c:       # a Unix socket: unix:PATH
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        cold = r.json()["choices"][0]
    finally:
        fresh.stop()
    assert hot["text"] == cold["text"]
    assert hot["logprobs"]["tokens"] == cold["logprobs"]["tokens"]
    assert hot["logprobs"]["token_logprobs"] == cold["logprobs"]["token_logprobs"]
    assert hot["logprobs"]["top_logprobs"] == cold["logprobs"]["top_logprobs"]


# its own vLLM start (~35-60 s). make test keeps the class: a vLLM the user started on TCP, attached to while it
# computes with other weights, the snapshot loaded whole and proven, the user's vLLM serving on after the replica
# stops (tests/loader/engines/vllm/test_vllm_faults.py, on that module's vLLM, e.g.
# test_a_replica_stopped_while_its_start_loads_the_snapshot_into_the_paused_users_vllm_resumes_it)
@pytest.mark.slow
def test_a_vllm_started_by_the_user_attaches_and_is_checked_before_it_serves(llama_run, tmp_path):
    """``serve --engine vllm --attach URL``: vLLM started the user's way with the two documented settings."""
    from ckptdelta.loader.engines import build_engine
    from ckptdelta.loader.engines.vllm.server import VllmServer
    from ckptdelta.loader.reader import SnapshotReader

    model_dir = SnapshotReader(llama_run.url).materialize(1, str(tmp_path / "v1"))
    # worker extension + dev mode, on TCP as a user would start it (the replica's own vLLM is on a Unix socket)
    theirs = VllmServer(model_dir, served_name="their-name", args=VLLM_ARGS, port=free_port())
    assert theirs.url.startswith("http://127.0.0.1:")
    try:
        theirs.wait_ready()
        # not the weights it serves: the snapshot is loaded into it whole, in a pause, and proven
        other = build_engine("vllm", bucket=llama_run.url, snapshot=2, attach=theirs.url)
        try:
            assert other.version == 2
            assert bit_diff(VllmReplicaHandle.read_live(other, str(tmp_path)), llama_run.truth[2]) == []
        finally:
            other.close()
        rep = VllmReplicaHandle(build_engine("vllm", bucket=llama_run.url, snapshot=1, attach=theirs.url))
        try:
            assert bit_diff(rep.live_weights(str(tmp_path)), llama_run.truth[1]) == []
            assert rep.engine.model_name == "their-name"
            assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_version"] == 1
            assert rep.hotload(2)["state"] == "READY"
            assert bit_diff(rep.live_weights(str(tmp_path)), llama_run.truth[2]) == []
        finally:
            rep.close()
        assert theirs.proc.poll() is None  # closing an attached replica leaves the user's vLLM running
    finally:
        theirs.stop()


@pytest.mark.slow     # its own vLLM starts through the CLI, twice (~65 s); make test keeps CLI serving in test_demo.py
def test_serve_engine_vllm_from_the_command_line_and_a_replica_killed_mid_hotload_restarts_on_latest(llama_run,
                                                                                                     tmp_path):
    import signal
    import socket
    import subprocess
    import sys
    import time

    from ckptdelta.loader.engines.vllm.control import http_client

    def start(snapshot: str) -> tuple[subprocess.Popen, str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [os.path.join(os.path.dirname(sys.executable), "ckptdelta"), "serve", "--engine", "vllm",
               "--bucket", llama_run.url, "--snapshot", snapshot, "--port", str(port),
               "--cache-dir", str(tmp_path / "cache"), "--", *VLLM_ARGS]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"serve-{port}.log", "wb"))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/v1/status", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("ckptdelta serve --engine vllm did not come up")

    proc, url = start("1")
    st = httpx.get(url + "/v1/status", timeout=30).json()
    assert st["policy_version"] == 1 and st["engine"]["kind"] == "vllm"
    vllm_url = st["engine"]["url"]
    assert vllm_url.startswith("unix:")   # its own vLLM: a Unix socket only this user can reach, no TCP port
    assert os.stat(os.path.dirname(vllm_url[len("unix:"):])).st_mode & 0o777 == 0o700
    with http_client(vllm_url, timeout=30) as c:
        assert c.get("/health").status_code == 200
    assert httpx.post(url + "/v1/hotload", json={"snapshot": 0}, timeout=30).status_code == 202
    proc.send_signal(signal.SIGKILL)  # mid hot-load
    proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # its vLLM goes with it
        try:
            with http_client(vllm_url, timeout=1) as c:
                c.get("/health")
        except httpx.HTTPError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the killed replica's vLLM server is still answering")
    proc, url = start("latest")
    try:
        latest = max(llama_run.truth)
        body = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "return_engine_data": True},
                          timeout=60).json()
        assert body["engine_data"]["policy_version"] == latest == httpx.get(url + "/v1/status").json()["policy_version"]
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("cache_policy", ["recompute", "keep"])
def test_requests_in_flight_through_a_hotload_all_finish_and_report_the_span(rep, llama_run, cache_policy):
    rep.engine.cache_policy = rep.engine.applier.cache_policy = cache_policy
    assert rep.hotload(0)["state"] == "READY"
    results: list = []
    swapped = threading.Event()
    started = threading.Barrier(7)

    def sample() -> None:  # requests back to back until one more has started after the swap
        with httpx.Client(base_url=rep.url, timeout=120) as c:
            started.wait()
            while True:
                done = swapped.is_set()
                results.append(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True,
                                                               "temperature": 1.0, "return_engine_data": True}))
                if done or len(results) > 400:
                    return

    threads = [threading.Thread(target=sample) for _ in range(6)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.5)  # requests are decoding
    job = rep.hotload(2)
    swapped.set()
    for t in threads:
        t.join()
    rep.engine.cache_policy = rep.engine.applier.cache_policy = "recompute"
    assert job["state"] == "READY", job
    # built and read back beside vLLM's steps (kernel calls take turns with them), then swapped in
    assert rep.http.get("/v1/status").json()["engine"]["last_swap"]["apply"] == "shadow"
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200][:2]
    spans = [r.json()["engine_data"]["policy_versions"] for r in results]
    assert all(s in ([0], [2], [0, 2]) for s in spans), spans
    assert [0, 2] in spans  # some requests were in flight during the swap
    for r in results:
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "length"  # nothing aborted
        assert r.json()["usage"]["completion_tokens"] == 120
        assert r.json()["engine_data"]["cache_policy"] == cache_policy


def test_min_policy_version_answers_408_with_retry_after_and_the_client_waits_for_the_hotload(rep, llama_run):
    from ckptdelta.cli import main
    from ckptdelta.loader.client import RolloutClient

    assert rep.hotload(0)["state"] == "READY"
    r = rep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_policy_version": 2})
    assert r.status_code == 408 and r.headers["retry-after"] and r.json()["error"]["policy_version"] == 0
    out: dict = {}
    with RolloutClient([rep.url], ready_timeout=120) as client:
        t = threading.Thread(target=lambda: out.update(client.sample(PROMPT, max_tokens=2, min_policy_version=2)))
        t.start()
        assert main(["hotload", rep.url, "2", "--wait"]) == 0  # the CLI, against the vLLM replica
        t.join(120)
        assert out["engine_data"]["policy_version"] == 2
        states = client.hotload("latest", wait=True)
        assert all(s["state"] == "READY" for s in states.values())
    assert rep.engine.version == max(llama_run.truth)


def test_a_failed_hotload_leaves_vllm_serving_its_previous_version_bit_exact(rep, llama_run, tmp_path, monkeypatch):
    from ckptdelta.loader.engines.vllm import applier as vllm_engine

    assert rep.hotload(2)["state"] == "READY"
    before = rep.complete(max_tokens=6, temperature=0)["choices"][0]["text"]
    # 1. a stored delta object corrupted at rest: refused while preparing, vLLM untouched
    v = llama_run.step(seed=900)
    deltas = os.path.join(llama_run.url, "deltas")
    d = next(x for x in sorted(os.listdir(deltas)) if x.startswith(f"{v:012d}-"))
    obj = os.path.join(deltas, d, sorted(os.listdir(os.path.join(deltas, d)))[0])
    data = bytearray(open(obj, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(obj, "wb").write(bytes(data))
    job = rep.hotload(v - 1)  # v-1 is a good delta on the way
    assert job["state"] == "READY"
    job = rep.hotload(v)
    assert job["state"] == "FAILED" and job["reason"], job
    assert rep.engine.version == v - 1
    assert _kernel_diff(rep, llama_run.truth[v - 1], str(tmp_path)) == []
    # 2. the live weights disagree with the snapshot after vLLM reloaded them (pushed back, still the old
    #    version): the engine contract's failed apply (TestVllmEngine.fail_next_apply below)
    assert rep.hotload(2)["state"] == "READY"
    # 3. vLLM fed half a fused group (its known trap: the missing members' rows are left uninitialised), caught
    #    by the sampled in-pause check and pushed back whole
    monkeypatch.setattr(rep.engine.applier, "verify", "sampled")
    real_groups = vllm_engine.reload_groups

    calls = []

    def half_groups(names, all_names, packed):  # wrong for the swap (its shadow, then its reload in the pause)
        calls.append(1)
        monkeypatch.setattr(vllm_engine, "reload_groups", real_groups)
        return [n for n in real_groups(names, all_names, packed) if ".k_proj." not in n]

    monkeypatch.setattr(vllm_engine, "reload_groups", half_groups)
    job = rep.hotload(1)
    assert job["state"] == "FAILED" and "differ" in job["reason"] and "qkv" not in job["reason"], job
    assert len(calls) == 1   # the shadow refused the half module (a warning), the pause's reload was caught
    assert rep.engine.version == 2 and _weight_version(rep) == "2"
    assert bit_diff(rep.live_weights(str(tmp_path)), llama_run.truth[2]) == []
    assert rep.complete(max_tokens=6, temperature=0)["choices"][0]["text"] == before
    # 4. hostile snapshot names get the reference replica's answers
    for snap, status in (("../x", 400), ("a/b", 400), (-1, 400), (999, 404), ("v" + "9" * 10, 404)):
        assert rep.post("/v1/hotload", {"snapshot": snap}).status_code == status, snap


def test_auth_holds_on_every_endpoint_of_a_vllm_replica(rep):
    from ckptdelta.loader.server import create_app
    from tests.replicas import LiveServer

    with LiveServer(create_app(rep.engine, replica_id="vllm-auth", api_key="s3cret")) as srv:
        for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}), ("/v1/hotload", {"snapshot": 0})):
            assert httpx.post(srv.url + path, json=body, timeout=60).status_code == 401
        assert httpx.get(srv.url + "/v1/status", timeout=60).status_code == 401
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                        headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert ok.status_code == 200, ok.text
        m = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert m.status_code == 200 and "ckptdelta_policy_version" in m.text


def test_the_openai_client_streams_and_not_through_the_vllm_replica(rep, llama_run):
    """vLLM's own events forwarded, the replica's engine_data chunk before [DONE], usage only when asked for."""
    import openai

    v = rep.engine.version
    target = 2 if v == 1 else 1     # the hot-load the streams go through (1 and 2: good deltas of the fixture's run)
    extra = {"ignore_eos": True, "return_token_ids": True}
    with openai.OpenAI(base_url=rep.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        assert model == rep.engine.model_name
        plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                                extra_body={**extra, "return_engine_data": True}))
        assert "".join(c.text for ch in chunks for c in ch.choices) == plain.choices[0].text
        ids = [t for ch in chunks for c in ch.choices for t in c.model_extra.get("token_ids") or []]
        assert ids == plain.choices[0].model_extra["token_ids"] and len(ids) == 8
        assert chunks[-1].choices == [] and chunks[-1].model_extra["engine_data"]["policy_versions"] == [v]
        assert all(ch.usage is None for ch in chunks)   # the usage chunk the replica asked vLLM for stays there

        msgs = [{"role": "user", "content": "hello"}]
        plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                               extra_body=extra)
        chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body=extra))
        text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        assert text == plain.choices[0].message.content and chunks[-1].usage.completion_tokens == 6
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=2, stream=True)
        assert info.value.body["code"] == "model_not_found"
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True,
                                      extra_body={"min_policy_version": 99})
        assert info.value.status_code == 408

        # streams back to back while a hot-load runs: every one whole, some of them across the swap
        results: list = []
        swapped = threading.Event()

        def stream() -> None:
            while True:
                done = swapped.is_set()
                chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=100, stream=True,
                                                        extra_body={**extra, "return_engine_data": True}))
                results.append(chunks)
                if done or len(results) > 300:
                    return

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        job = rep.hotload(target)
        swapped.set()
        for t in threads:
            t.join()
    assert job["state"] == "READY", job
    spans = [chunks[-1].model_extra["engine_data"]["policy_versions"] for chunks in results]
    assert all(s in ([v], [target], [v, target]) for s in spans) and [v, target] in spans, spans
    for chunks in results:
        assert sum(len(c.model_extra.get("token_ids") or []) for ch in chunks for c in ch.choices) == 100
        assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]


_PUSHES = ("ckptdelta_swap", "ckptdelta_reload", "ckptdelta_patch")   # the RPCs that write vLLM's live weights


@pytest.mark.parametrize("verify", ["sampled", "full"])
def test_spans_hold_every_version_vllm_served_at_every_phase_point_of_three_hotloads(rep, llama_run, monkeypatch,
                                                                                     verify):
    """Issue 39's case and its class, on the real vLLM replica: requests admitted (VllmReplica.admit, as every
    request and stream is) at every phase point of three hot-loads (0 -> 1 -> 2 -> 1), each point before and
    after every call the swap makes to vLLM (building the shadow while serving, pausing, pushing, proving,
    resetting the prefix cache, labelling, resuming, proving after resuming), and completed (its answer back) at
    that point and every later one. vLLM computes nothing from its pause to its resume, and with the old bits
    until a push: a span must be the versions served from its admission to its completion, one stretch of the
    sequence, none left out. A request admitted in the first pause and answered after the second hot-load once
    reported [0, 2]: v1 generated its tokens."""
    engine, control = rep.engine, rep.engine.applier.control
    assert rep.hotload(0)["state"] == "READY"
    monkeypatch.setattr(engine.applier, "verify", verify)
    me = threading.current_thread()
    served = [0]                             # the versions vLLM computed with, in order
    now = {"paused": False, "pushed": False, "target": None}
    where: list[tuple[int, int]] = []        # per point: the positions in ``served`` a span may start or end at
    phases: list[tuple[int, str]] = []       # per point: (position of the version served last, phase)
    waiting: list[list] = []                 # per point: requests admitted there, not answered yet
    spans: list[tuple[int, int, list]] = []  # (admitted at, answered at, versions reported)
    body = {"prompt": PROMPT, "max_tokens": 1}
    per_point = 150

    def point() -> None:
        if threading.current_thread() is not me:     # the watch's probes are not the swap's phases
            return
        k = len(served) - 1
        where.append((k, k + 1) if now["paused"] and now["pushed"] else (k, k))
        phases.append((k, "pushed" if now["pushed"] else "paused" if now["paused"] else "serving"))
        q = len(where) - 1
        assert q < per_point, "more phase points than requests admitted at each"
        waiting.append([engine.admit(body) for _ in range(per_point)])
        for p in range(q + 1):
            spans.append((p, q, waiting[p].pop().versions()))

    def after_pause(*_a) -> None:
        now.update(paused=True, pushed=False)

    def after_rpc(method, *_a) -> None:
        if now["paused"] and method in _PUSHES:
            now["pushed"] = True

    def after_resume(*_a) -> None:
        served.append(now["target"])
        now.update(paused=False, pushed=False)

    for name, after in (("pause", after_pause), ("resume", after_resume), ("rpc", after_rpc), ("poll", None),
                        ("reset_prefix_cache", None), ("set_version", None)):
        def call(*args, _real=getattr(control, name), _after=after, **kwargs):
            point()
            out = _real(*args, **kwargs)
            if _after is not None and threading.current_thread() is me:
                _after(*args)
            point()
            return out

        monkeypatch.setattr(control, name, call)
    for target in (1, 2, 1):
        now["target"] = target
        point()
        pauses = len(served)
        engine.swapper.hotload(target)
        assert engine.version == target and len(served) == pauses + 1     # one pause, then serving the target
        point()
    for admitted in (a for w in waiting for a in w):
        admitted.release()

    wrong = []
    for p, q, versions in spans:
        (i0, i1), (j0, j1) = where[p], where[q]
        if not any(served[i:j + 1] == versions for i in range(i0, i1 + 1) for j in range(max(i, j0), j1 + 1)):
            wrong.append(f"admitted at point {p} {where[p]}, answered at {q} {where[q]}: {versions}")
    assert wrong == [], f"vLLM served {served}; " + "; ".join(wrong[:10])
    # the reported case itself: admitted in the first pause, answered once the second hot-load is served
    p, q = phases.index((0, "paused")), phases.index((2, "serving"))
    assert [v for a, b, v in spans if (a, b) == (p, q)] == [[0, 1, 2]]


# tied embeddings (Qwen2 and Llama, published as modules from fp32 masters): tests/loader/engines/vllm/test_hf_policies.py
@pytest.mark.parametrize("save", [save_tiny_moe], ids=["qwen2-moe"])
def test_tied_embeddings_and_experts_hotload_bit_exact(save, tmp_path):
    run = publish_vllm_run(str(tmp_path / "bucket" / "run"), save(str(tmp_path / "model")), deltas=2)
    rep = start_vllm_replica(run, 0, cache_dir=str(tmp_path / "cache"))
    try:
        for target in (1, 2, 0):
            job = rep.hotload(target)
            assert job["state"] == "READY", job
            assert bit_diff(rep.live_weights(str(tmp_path)), run.truth[target]) == [], target
            assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_version"] == target
            # a tied head is re-packed in the shadow with its embedding; CPU experts are still reloaded in the pause
            apply = rep.http.get("/v1/status").json()["engine"]["last_swap"]["apply"]
            assert apply == ("shadow+reload" if save is save_tiny_moe else "shadow"), apply
    finally:
        rep.close()
        run.publisher.close()


class TestVllmEngine(EngineContract):
    """The engine contract (tests/loader/engines/conformance.py) on vLLM serving full weights, on the module's
    replica: defined last, so that it runs after the module's other tests, and its last case stops it."""

    kind = "vllm"

    @pytest.fixture
    def replica(self, rep):
        return rep

    @pytest.fixture
    def published(self, llama_run):
        return llama_run

    def hotload_path(self, published):
        """Over v0-v2 and an anchor and a delta of the contract's own, past whatever the module's other tests
        published (one of which is corrupted at rest)."""
        if not hasattr(published, "contract"):
            anchor = published.publish(rl_step(published.truth[2], seed=77), anchor=True)
            published.contract = (anchor, published.step(seed=78))
        reader = SnapshotReader(published.url)
        return [1, 2, published.contract[1], 0, 2], {v for v in published.truth if reader.manifest(v).kind == "anchor"}

    def generations(self, replica):
        return vllm_generations(replica.engine)

    def live_diff(self, replica, published, version, tmp_path):
        return bit_diff(replica.live_weights(str(tmp_path)), published.truth[version])

    def fail_next_apply(self, replica, monkeypatch):
        """The live weights disagree with the snapshot after vLLM took them (one digest of the proof wrong, the
        whole proof inside the pause): the host copy is rolled back and pushed again."""
        from ckptdelta.loader.engines.vllm import applier as vllm_applier

        real = vllm_applier.expected_digests

        def one_wrong(shared, names, kernel=frozenset(), slices=None):
            out = real(shared, names, kernel, slices)
            out[sorted(out)[0]] = "0" * 16
            monkeypatch.setattr(vllm_applier, "expected_digests", real)  # only the first check is wrong
            return out

        monkeypatch.setattr(vllm_applier, "expected_digests", one_wrong)
        monkeypatch.setattr(replica.engine.applier, "verify", "full")

    def assert_released(self, replica):
        assert replica.engine.server.proc.poll() is not None            # vLLM's process group is gone
        assert not os.path.exists(replica.engine.shared.path)           # and the shared host copy
