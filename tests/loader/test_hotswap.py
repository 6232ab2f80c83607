"""ckptdelta.loader.hotswap: moving live weights between versions with one pause, or not at all."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import MutableMapping

import pytest
import torch

from ckptdelta.delta import digest
from ckptdelta.delta.errors import (DeltaError, HotLoadConflictError, HotLoadError, ParentMismatchError,
                                    ShapeMismatchError)
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.gate import ServingGate
from ckptdelta.loader.reader import SnapshotReader
from tests.bucketgen import bits_equal, make_run, write_run


@pytest.fixture
def run(tmp_path):
    """Anchors at 0 and 5; deltas 1-4 and 6-7."""
    return make_run(str(tmp_path / "run"), n_versions=8, anchors={5})


def clone(d: dict) -> dict:
    return {k: t.clone() for k, t in d.items()}


def assert_at(live: dict, run, v: int) -> None:
    assert sorted(live) == sorted(run.truth[v])
    for k, t in run.truth[v].items():
        assert bits_equal(live[k], t), (v, k)


def swapper_at(run, v: int, **kw) -> tuple[dict, HotSwapper]:
    live = clone(run.truth[v])
    return live, HotSwapper(live, SnapshotReader(run.url), version=v, **kw)


# --- routes ---------------------------------------------------------------------------------

def test_forward_one_delta(run):
    live, sw = swapper_at(run, 0)
    assert sw.plan(1) == [1]
    rep = sw.hotload(1)
    assert_at(live, run, 1)
    assert (sw.version, sw.snapshot) == (1, "v00000001")
    assert rep.from_version == 0 and rep.to_version == 1 and rep.path == [1] and not rep.via_anchor
    assert rep.tensors_changed == len(run.truth[1]) - 1      # the frozen tensor is untouched
    assert 0 < rep.bytes_fetched <= run.manifests[1].stored_bytes
    assert rep.pause_s >= rep.apply_s >= 0 and rep.total_s >= rep.pause_s


def test_forward_several_deltas_in_one_swap(run):
    live, sw = swapper_at(run, 1)
    rep = sw.hotload(4)
    assert rep.path == [2, 3, 4] and not rep.via_anchor
    assert_at(live, run, 4)


def test_backward_rollback(run):
    live, sw = swapper_at(run, 4)
    rep = sw.hotload("v00000002")
    assert_at(live, run, 2)
    assert rep.via_anchor and rep.path == [0, 1, 2]
    sw.hotload(3)
    assert_at(live, run, 3)


def test_through_an_anchor(run):
    live, sw = swapper_at(run, 2)
    rep = sw.hotload(7)
    assert rep.via_anchor and rep.path == [5, 6, 7]
    assert_at(live, run, 7)
    sw.hotload("latest")
    assert sw.version == 7


def test_every_pair_of_versions(tmp_path):
    run = make_run(str(tmp_path / "run"), n_versions=5, anchors={3}, seed=9)
    for a in range(5):
        for b in range(5):
            live, sw = swapper_at(run, a)
            sw.hotload(b)
            assert_at(live, run, b)


def test_a_hotload_fetches_its_records_in_stored_order_in_a_request_or_two_per_batch(tmp_path, monkeypatch):
    """Groups are fetched in the order their records lie in the store, not in name order: each batch is then a run
    of neighbouring bytes, one request, or two where it crosses into the next object. Here consecutive names lie in
    four objects round-robin, so a batch taken in name order would ask every object it touches (32 requests
    where this test allows 13); the commit and the result are the same."""
    import ckptdelta.loader.reader as reader_mod

    g = torch.Generator().manual_seed(3)
    v0 = {f"w{i:02d}": torch.randn(4096, generator=g) for i in range(32)}
    v1 = {k: t + 1e-3 * torch.randn(4096, generator=g) for k, t in v0.items()}
    run = write_run(str(tmp_path / "run"), versions=[v0, v1], objects_per_delta=4)
    records = [e.length for e in run.manifests[1].tensors.values() if e.object is not None]
    assert len(records) == 32 and len({e.object for e in run.manifests[1].tensors.values()}) == 4
    monkeypatch.setattr(reader_mod, "FIRST_BATCH_BYTES", 2 * max(records))
    live, sw = swapper_at(run, 0)
    requests: list[list] = []
    real = sw.reader.store.get_many

    def counted(items):
        items = list(items)
        requests.append(items)
        return real(items)

    monkeypatch.setattr(sw.reader.store, "get_many", counted)
    prepared = sw.prepare(1)
    assert [s.name for s in prepared.staged] == sorted(v1)      # staged, then committed, in the planned order
    sw.commit(prepared)
    assert_at(live, run, 1)
    n = sum(len(r) for r in requests)
    assert len(requests) >= 6, requests                        # batches of a few records each
    assert n <= len(requests) + 4 - 1, [[(k.rsplit("/", 1)[-1], r) for k, r in batch] for batch in requests]
    for batch in requests:                                     # each object read front to back, no byte twice
        assert len({k for k, _ in batch}) == len(batch)
    spans = sorted((k, r[0], r[1]) for batch in requests for k, r in batch)
    for (k1, _s1, e1), (k2, s2, _e2) in zip(spans, spans[1:]):
        assert k1 != k2 or e1 <= s2


def test_from_unknown_weights_only_through_load_initial(run):
    live = {k: torch.zeros_like(t) for k, t in run.truth[0].items()}
    sw = HotSwapper(live, SnapshotReader(run.url))
    with pytest.raises(HotLoadError, match="load_initial"):
        sw.hotload(6)
    rep = sw.load_initial(6)
    assert rep.from_version is None and rep.via_anchor and rep.path == [5, 6]
    assert_at(live, run, 6)
    sw.hotload(7)
    assert_at(live, run, 7)


def test_name_map_translates_checkpoint_names(run):
    live = {"module." + k: t.clone() for k, t in run.truth[0].items()}
    sw = HotSwapper(live, SnapshotReader(run.url), version=0, name_map=lambda n: "module." + n)
    sw.hotload(6)
    assert_at({k[len("module."):]: t for k, t in live.items()}, run, 6)


def test_same_version_is_a_no_op(run):
    live, sw = swapper_at(run, 3)
    rep = sw.hotload(3)
    assert rep.tensors_changed == 0 and rep.bytes_fetched == 0 and rep.path == []
    assert_at(live, run, 3)


# --- refusals that leave the weights untouched ----------------------------------------------------

def test_corrupt_delta_fails_prepare_and_keeps_old_weights(run):
    m = run.manifests[2]
    e = m.tensors["lm_head.weight"]
    key = m.objects[e.object].key
    data = bytearray(run.store.get(key))
    data[e.offset + e.length - 2] ^= 0x10                    # inside a chunk payload
    run.store.put(key, bytes(data))
    live, sw = swapper_at(run, 1)
    with pytest.raises(DeltaError, match="lm_head.weight"):
        sw.hotload(3)
    assert sw.version == 1
    assert_at(live, run, 1)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_staging_on_several_threads_gives_the_same_update(run, threads):
    """Tensors stage side by side; the prepared update (tensors in manifest order, their positions
    and bits) and the weights after the swap are those of staging one by one."""
    _, one = swapper_at(run, 1, stage_threads=1)
    want = one.prepare(4)
    live, sw = swapper_at(run, 1, stage_threads=threads)
    got = sw.prepare(4)
    assert [s.name for s in got.staged] == [s.name for s in want.staged]
    for a, b in zip(got.staged, want.staged):
        assert (a.st.positions.tobytes(), a.st.values.tobytes()) == (b.st.positions.tobytes(), b.st.values.tobytes())
        assert (a.st.dense is None) == (b.st.dense is None)
    sw.commit(got)
    assert_at(live, run, 4)


def test_tensors_really_stage_at_the_same_time(run, monkeypatch):
    """Two stagings must be inside stage_one at once: one by one, the barrier would time out."""
    import ckptdelta.loader.hotswap as hs

    barrier = threading.Barrier(2, timeout=60)
    calls = []
    real = hs.stage_one

    def meeting(*a, **kw):
        calls.append(threading.current_thread().name)
        if len(calls) <= 2:
            barrier.wait()
        return real(*a, **kw)

    monkeypatch.setattr(hs, "stage_one", meeting)
    live, sw = swapper_at(run, 1, stage_threads=2)
    sw.hotload(2)
    assert_at(live, run, 2)
    assert len(set(calls[:2])) == 2


def test_stage_threads_follow_the_bytes_of_the_changed_tensors():
    from ckptdelta.loader.staging import STAGE_BYTES_PER_THREAD, stage_threads_for

    assert stage_threads_for(0, 8) == 1
    assert stage_threads_for(STAGE_BYTES_PER_THREAD - 1, 8) == 1          # a small LoRA adapter's step: one
    assert stage_threads_for(3 * STAGE_BYTES_PER_THREAD, 8) == 3
    assert stage_threads_for(100 * STAGE_BYTES_PER_THREAD, 8) == 8        # a full model's step: every core
    assert stage_threads_for(100 * STAGE_BYTES_PER_THREAD, 1) == 1


@pytest.mark.parametrize("asked, per_thread, want", [(None, None, 1), (None, 1, 8), (2, None, 2)])
def test_a_hotload_stages_on_as_many_threads_as_its_changed_bytes_pay_for(run, monkeypatch, asked, per_thread,
                                                                          want):
    """Unless told, a hot-load stages on one thread per STAGE_BYTES_PER_THREAD of changed tensors, at most one
    per core (this run's tensors are small: one thread, unless each thread is given a byte), and the update is
    the same."""
    import ckptdelta.loader.hotswap as hs
    from ckptdelta.loader import staging

    seen = []
    real = hs.Stager

    def recording(fn, threads, pool=None):
        seen.append(threads)
        assert (pool is None) == (threads == 1) and (pool is None or pool.n == threads)
        return real(fn, threads, pool)

    monkeypatch.setattr(hs, "Stager", recording)
    monkeypatch.setattr(hs.os, "cpu_count", lambda: 8)
    if per_thread is not None:
        monkeypatch.setattr(staging, "STAGE_BYTES_PER_THREAD", per_thread)
    live, sw = swapper_at(run, 1, stage_threads=asked)
    sw.hotload(2)
    assert_at(live, run, 2)
    assert seen == [want]


def test_a_failing_tensor_among_parallel_stagings_leaves_no_staging_running(run, monkeypatch):
    import ckptdelta.loader.hotswap as hs

    real = hs.stage_one
    started = []

    def slow_or_failing(name, *a, **kw):
        started.append(name)
        if name == "lm_head.weight":
            raise ParentMismatchError(f"tensor {name!r}: injected")
        time.sleep(0.05)
        return real(name, *a, **kw)

    monkeypatch.setattr(hs, "stage_one", slow_or_failing)
    live, sw = swapper_at(run, 1, stage_threads=4)
    with pytest.raises(ParentMismatchError, match="lm_head.weight"):
        sw.hotload(2)
    assert all(pool.busy == 0 for pool in sw._stage_pools.values()) and sw._stage_pools   # none staging now
    n = len(started)
    time.sleep(0.2)
    assert len(started) == n                   # nothing staged after prepare returned
    assert sw.version == 1 and not sw.busy
    assert_at(live, run, 1)


def test_live_weights_not_of_their_version_are_refused(run):
    live, sw = swapper_at(run, 1)
    live["lm_head.weight"].view(-1).view(torch.int16)[3] += 1
    before = clone(live)
    with pytest.raises(ParentMismatchError, match="lm_head.weight"):
        sw.hotload(2)
    with pytest.raises(ParentMismatchError, match="lm_head.weight"):
        sw.hotload(7)                                          # the anchor route checks too
    assert sw.version == 1
    for k in live:
        assert bits_equal(live[k], before[k])


def test_names_and_shapes_must_match(run):
    live = clone(run.truth[0])
    live["surplus"] = torch.zeros(3)
    del live["model.norm.weight"]
    sw = HotSwapper(live, SnapshotReader(run.url))
    with pytest.raises(HotLoadError, match=r"model\.norm\.weight.*surplus"):
        sw.load_initial(1)
    live = clone(run.truth[0])
    live["lm_head.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(ShapeMismatchError, match="lm_head.weight"):
        HotSwapper(live, SnapshotReader(run.url)).load_initial(1)


class ArmedDict(MutableMapping):
    """A live mapping that raises when one key is looked up after being armed (a fault in the pause)."""

    def __init__(self, d: dict, bad: str):
        self.d, self.bad, self.armed = d, bad, False

    def __getitem__(self, k):
        if self.armed and k == self.bad:
            raise RuntimeError("device lost")
        return self.d[k]

    def __setitem__(self, k, v):
        self.d[k] = v

    def __delitem__(self, k):
        del self.d[k]

    def __iter__(self):
        return iter(self.d)

    def __len__(self):
        return len(self.d)


def test_failure_mid_commit_restores_applied_tensors(run):
    names = sorted(run.truth[0])
    bad = names[-2]                                   # applied in name order: most are done before it fails
    live = ArmedDict(clone(run.truth[0]), bad)
    sw = HotSwapper(live, SnapshotReader(run.url), version=0)
    prepared = sw.prepare(3)
    live.armed = True
    with pytest.raises(HotLoadError, match="restored"):
        sw.commit(prepared)
    assert sw.version == 0
    assert_at(live.d, run, 0)
    live.armed = False
    sw.commit(prepared)
    assert_at(live.d, run, 3)


def test_failure_mid_commit_restores_densely_staged_tensors(run):
    live = {k: torch.zeros_like(t) for k, t in run.truth[0].items()}
    zeros = clone(live)
    sw = HotSwapper(live, SnapshotReader(run.url))
    prepared = sw.prepare(2, initial=True)
    assert any(s.st.dense is not None for s in prepared.staged)
    last = prepared.staged[-1].live_name
    original = live[last]
    live[last] = original.clone()                    # replaced after prepare: commit must refuse it
    with pytest.raises(HotLoadError, match="replaced"):
        sw.commit(prepared)
    assert sw.version is None
    for k in live:
        assert bits_equal(live[k], zeros[k]), k
    live[last] = original                            # the failed commit left the prepared update whole
    sw.commit(prepared)
    assert_at(live, run, 2)


def test_stale_prepared_update_is_refused(run):
    live, sw = swapper_at(run, 1)
    p2 = sw.prepare(2)
    sw.hotload(3)
    with pytest.raises(HotLoadError, match="prepared from version 1"):
        sw.commit(p2)
    assert_at(live, run, 3)


def test_one_hot_load_at_a_time(run):
    live, sw = swapper_at(run, 0)
    result = {}
    gate_entered, release = threading.Event(), threading.Event()

    def step():
        with sw.gate.serving():
            gate_entered.set()
            release.wait(30)

    server = threading.Thread(target=step)
    server.start()
    gate_entered.wait(30)
    loader = threading.Thread(target=lambda: result.setdefault("rep", sw.hotload(1)))
    loader.start()
    deadline = time.monotonic() + 30
    while not sw.gate.is_paused and time.monotonic() < deadline:   # the swap waits for the running step
        time.sleep(0.01)
    assert sw.gate.is_paused
    with pytest.raises(HotLoadConflictError):
        sw.hotload(2)
    release.set()
    server.join(30)
    loader.join(30)
    assert result["rep"].to_version == 1
    assert_at(live, run, 1)


# --- the gate ---------------------------------------------------------------------------------------

def paired_versions(n: int, size: int = 50_000) -> list[dict[str, torch.Tensor]]:
    """Versions whose tensors "a" and "b" are always equal to each other, and differ from version to version."""
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(size, generator=g) * 0.02).bfloat16()
    out = []
    for _v in range(n):
        a = a.clone()
        mask = torch.rand(size, generator=g) < 0.5
        a.view(torch.int16)[mask] += 1
        out.append({"a": a.clone(), "b": a.clone()})
    return out


def test_no_forward_step_sees_half_applied_weights(tmp_path):
    run = write_run(str(tmp_path / "run"), versions=paired_versions(6), anchors={3}, chunk_elems=4096)
    digests = {v: digest(t["a"]) for v, t in run.truth.items()}
    live = clone(run.truth[0])
    sw = HotSwapper(live, SnapshotReader(run.url), version=0)
    stop = threading.Event()
    errors, steps = [], []

    def forward():
        last = -1
        n = 0
        while not stop.is_set():
            with sw.gate.serving():
                v = sw.version
                da, db = digest(live["a"]), digest(live["b"])
            if not (da == db == digests[v]):
                errors.append(f"version {v}: a and b are not both that version's")
            if v < last:
                errors.append(f"version went back from {last} to {v}")
            last = v
            n += 1
        steps.append(n)

    threads = [threading.Thread(target=forward) for _ in range(3)]
    for t in threads:
        t.start()
    for v in (1, 2, 4, 5):
        sw.hotload(v)
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[:5]
    assert min(steps) > 0
    assert_at(live, run, 5)


class _Stop(BaseException):
    """What a stop signal's handler raises in the main thread (as loader/stopping.py's TerminationRequested)."""


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="a real signal interrupts the wait")
def test_a_signal_that_interrupts_a_pause_waiting_for_steps_lets_steps_run_again():
    """A swap run on the main thread (an embedder's hotload()) waits in paused() for the running steps; a stop
    signal's exception raised there must not leave the gate paused, or every later step would wait for good."""
    gate = ServingGate()
    held, release = threading.Event(), threading.Event()

    def step():
        with gate.serving():
            held.set()
            release.wait(30)

    def stop(signum, frame):
        raise _Stop()

    t = threading.Thread(target=step)
    t.start()
    assert held.wait(30)
    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(_Stop):
            with gate.paused():
                pass
        timer.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    release.set()
    t.join(30)
    assert not gate.is_paused
    later = threading.Thread(target=lambda: gate.serving().__enter__(), daemon=True)
    later.start()
    later.join(5)
    assert not later.is_alive(), "a step after the interrupted pause is still held back"


def test_gate_refuses_to_pause_from_inside_a_step_and_times_out():
    gate = ServingGate()
    with gate.serving():
        with gate.serving():                                   # nested sections are fine
            pass
        with pytest.raises(HotLoadError, match="inside a serving section"):
            with gate.paused():
                pass
    held, release = threading.Event(), threading.Event()

    def step():
        with gate.serving():
            held.set()
            release.wait(30)

    t = threading.Thread(target=step)
    t.start()
    held.wait(30)
    with pytest.raises(HotLoadError, match="still running"):
        with gate.paused(timeout=0.05):
            pass
    with gate.serving():                                       # steps are not held back after giving up
        pass
    release.set()
    t.join(30)
    with gate.paused() as pause:
        assert gate.is_paused and gate.active == 0
    assert pause.seconds >= pause.waited_s >= 0 and not gate.is_paused


# --- apply paths and real modules -----------------------------------------------------------------------

def test_torch_apply_path_gives_the_same_bits(run):
    live_a, sw_a = swapper_at(run, 0)
    live_b, sw_b = swapper_at(run, 0, apply_method="torch")
    for v in (3, 1, 7, 6):
        sw_a.hotload(v)
        sw_b.hotload(v)
        assert_at(live_a, run, v)
        assert_at(live_b, run, v)
    live = {k: torch.zeros_like(t) for k, t in run.truth[0].items()}   # dense changes
    sw = HotSwapper(live, SnapshotReader(run.url), apply_method="torch")
    sw.load_initial(4)
    assert_at(live, run, 4)


def test_failed_torch_path_commit_restores_dense_and_sparse_tensors(run):
    names = sorted(run.truth[0])
    start = {k: (torch.zeros_like(t) if i % 2 else t.clone()) for i, (k, t) in enumerate(sorted(run.truth[0].items()))}
    live = ArmedDict(clone(start), names[-1])
    sw = HotSwapper(live, SnapshotReader(run.url), apply_method="torch")
    prepared = sw.prepare(1, initial=True)
    kinds = {s.st.dense is None for s in prepared.staged}
    assert kinds == {True, False}
    live.armed = True
    with pytest.raises(HotLoadError):
        sw.commit(prepared)
    for k in start:
        assert bits_equal(live.d[k], start[k]), k
    live.armed = False
    sw.commit(prepared)
    assert_at(live.d, run, 1)


def test_non_contiguous_live_tensors(run):
    live = {k: (t.t().contiguous().t() if t.dim() == 2 else t.clone()) for k, t in run.truth[0].items()}
    assert not live["lm_head.weight"].is_contiguous()
    sw = HotSwapper(live, SnapshotReader(run.url), version=0)
    sw.hotload(2)
    assert_at(live, run, 2)
    sw.hotload(6)
    assert_at(live, run, 6)
    for t in live.values():
        t.zero_()
    sw = HotSwapper(live, SnapshotReader(run.url))
    sw.load_initial(3)                                          # dense changes into strided tensors
    assert_at(live, run, 3)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8).to(torch.bfloat16)
        self.head = torch.nn.Linear(8, 16, bias=False).to(torch.bfloat16)
        self.head.weight = self.embed.weight                     # tied
        self.norm = torch.nn.LayerNorm(8)
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


def test_module_with_tied_weights_and_buffers(tmp_path):
    ref = Tied()
    sd = {k: v.clone() for k, v in ref.state_dict().items() if k != "head.weight"}   # saved once, like HF
    v1 = clone(sd)
    v1["embed.weight"].view(torch.int16)[0, :3] += 1
    v1["scale"][2] = -0.0
    run = write_run(str(tmp_path / "run"), versions=[sd, v1])
    model = Tied()
    model.load_state_dict({**sd, "head.weight": sd["embed.weight"]})
    sw = HotSwapper(model, SnapshotReader(run.url), version=0)
    rep = sw.hotload(1)
    assert rep.tensors_changed == 2
    assert bits_equal(model.embed.weight.detach(), v1["embed.weight"])
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert bits_equal(model.scale, v1["scale"])
    sw.hotload(0)
    assert bits_equal(model.head.weight.detach(), sd["embed.weight"])


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _rl_step(sd: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        mask = torch.rand(t.shape, generator=g) < 0.05
        out[k] = torch.where(mask, (t.float() + torch.randn(t.shape, generator=g) * 0.05).to(t.dtype), t)
    return out


def test_real_model_after_swaps_matches_a_fresh_load_of_the_materialized_snapshot(tmp_path):
    from transformers import LlamaForCausalLM

    model = _tiny_llama(0)
    sd0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    versions = [sd0]
    for i in range(1, 5):
        versions.append(_rl_step(versions[-1], i))
    run = write_run(str(tmp_path / "run"), versions=versions, anchors={3},
                    extra_files={"config.json": model.config.to_json_string().encode()})
    reader = SnapshotReader(run.url)

    def load(v: int):   # as a replica starts: from the materialized snapshot (so buffers match too)
        return LlamaForCausalLM.from_pretrained(reader.materialize(v, str(tmp_path / f"v{v}")),
                                                dtype=torch.bfloat16).eval()

    live = load(0)
    ids = torch.tensor([[1, 5, 9, 33, 2, 70, 11]])
    with torch.no_grad():
        before = live(ids).logits
    sw = HotSwapper(live, reader, version=0)
    sw.hotload(2)
    sw.hotload(4)
    sw.hotload(2)
    with torch.no_grad():
        got, want = live(ids).logits, load(2)(ids).logits
    assert bits_equal(got, want)
    assert not bits_equal(got, before)                                 # the swap did change the policy


def test_swaps_across_a_run_written_by_the_real_publisher(tmp_path):
    from ckptdelta.publisher.publisher import Publisher

    from tests.bucketgen import trajectory

    versions = trajectory(6, seed=8)
    with Publisher(str(tmp_path / "run"), anchor_every=4) as pub:
        for i, w in enumerate(versions):
            pub.publish(w, step=i)
    live = clone(versions[0])
    sw = HotSwapper(live, SnapshotReader(str(tmp_path / "run")), version=0)
    for v, route in ((2, [1, 2]), (5, [4, 5]), (1, [0, 1]), (3, [2, 3])):
        rep = sw.hotload(v)
        assert rep.path == route
        for k, t in versions[v].items():
            assert bits_equal(live[k], t), (v, k)


# --- faults between prepare and commit: allocations, copies, other writers ------------------------

def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """Same logical bits, non-contiguous storage (a transposed buffer): copying it allocates."""
    if t.dim() == 0 or t.numel() < 2:
        return t.clone()
    buf = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
    out = buf[..., ::2]
    out.copy_(t)
    return out


class FailNth:
    """The n-th call (from arming) of torch.Tensor.to/contiguous/copy_/clone raises, as a failed allocation or
    device copy does; every later call goes through. ``calls`` counts what the armed section ran."""

    METHODS = ("to", "contiguous", "copy_", "clone")

    def __init__(self, monkeypatch, n: int):
        self.n, self.calls, self.armed, self.fired = n, 0, False, None
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def method(t, *a, **kw):
            if self.armed:
                self.calls += 1
                if self.calls == self.n:
                    self.fired = f"{name} of a {'non-' if not t.is_contiguous() else ''}contiguous tensor"
                    raise RuntimeError(f"injected: cannot allocate memory ({name}, call {self.n})")
            return real(t, *a, **kw)
        return method


@pytest.fixture
def mixed_run(tmp_path):
    """Version 1 rewrites every element of two tensors (staged densely) and a few of two others (sparsely)."""
    g = torch.Generator().manual_seed(3)
    v0 = {f"{kind}.{i}": torch.randn(24, 40, generator=g).to(torch.bfloat16 if i else torch.float32)
          for kind in ("dense", "sparse") for i in range(2)}
    v1 = clone(v0)
    for k, t in v1.items():
        if k.startswith("dense"):
            t.add_(1.0)
        else:
            t.view(-1)[::97] += 1.0
    return write_run(str(tmp_path / "mixed"), versions=[v0, v1])


def test_a_commit_failing_at_any_allocation_or_copy_leaves_every_tensor_and_the_version_old(mixed_run,
                                                                                            monkeypatch):
    """Regression: a failed copy of a strided live tensor (or of its bits to the host) during a dense swap
    wrote the NEW bits into it while reporting a full rollback. Fail each torch copy/allocation of the
    commit in turn: every time, every tensor keeps its old bits, the version stays, and the same prepared
    update then commits."""
    run, target = mixed_run, 1
    reader = SnapshotReader(run.url)
    fired = []
    for n in range(1, 10_000):
        live = {k: strided_copy(t) if k.endswith("0") else t.clone() for k, t in run.truth[0].items()}
        sw = HotSwapper(live, reader, version=0, stage_threads=1)
        prepared = sw.prepare(target)
        kinds = {(s.st.dense is not None, live[s.live_name].is_contiguous()) for s in prepared.staged}
        assert kinds == {(True, False), (True, True), (False, False), (False, True)}  # dense/sparse, (non-)contiguous
        fault = FailNth(monkeypatch, n)
        fault.armed = True
        try:
            sw.commit(prepared)
        except HotLoadError as e:
            fault.armed = False
            assert "restored" in str(e), e
            fired.append(fault.fired)
        else:
            fault.armed = False
            assert fault.calls < n      # no fault left to inject: the commit went through
            assert_at(live, run, target)
            break
        assert sw.version == 0, n
        assert_at(live, run, 0)
        sw.commit(prepared)             # the failed commit left the prepared update whole
        assert sw.version == target
        assert_at(live, run, target)
        monkeypatch.undo()
    assert any("non-contiguous" in f for f in fired), fired


@pytest.mark.parametrize("apply_method", ["auto", "torch"])   # the kernel's check as it writes; a gather first
def test_a_sparse_change_to_a_tensor_written_after_prepare_is_refused_and_the_writes_kept(run, apply_method):
    live, sw = swapper_at(run, 0, apply_method=apply_method)
    prepared = sw.prepare(1)
    s = next(s for s in prepared.staged if s.st.dense is None)
    flat = live[s.live_name].view(-1)
    pos = int(s.st.positions[len(s.st.positions) // 2])
    flat[pos] = -flat[pos] if flat[pos] != 0 else 1.0          # another writer, in place
    written = clone(live)
    with pytest.raises(HotLoadError, match=f"{s.name!r}.*written after prepare"):
        sw.commit(prepared)
    assert sw.version == 0
    for k in live:
        assert bits_equal(live[k], written[k]), k              # nothing overwrote the other writer's bits


@pytest.mark.parametrize("other", ["dense.0", "dense.1"])   # strided (torch copies), contiguous (chunked swap)
def test_a_dense_change_to_a_tensor_written_after_prepare_is_refused_and_the_writes_kept(mixed_run, other):
    run = mixed_run
    live = {k: strided_copy(t) if k.endswith("0") else t.clone() for k, t in run.truth[0].items()}
    sw = HotSwapper(live, SnapshotReader(run.url), version=0)
    prepared = sw.prepare(1)
    assert next(s for s in prepared.staged if s.live_name == other).st.dense is not None
    live[other][-1, -1] = 7.0                                  # another writer, in place
    written = clone(live)
    with pytest.raises(HotLoadError, match=f"{other!r}.*written after prepare"):
        sw.commit(prepared)
    assert sw.version == 0
    for k in live:
        assert bits_equal(live[k], written[k]), k


# --- the commit's choice: scatter the changed elements or copy a staged whole tensor ------------------------

import numpy as np  # noqa: E402

from ckptdelta.delta import dtypes as _dtypes  # noqa: E402
from ckptdelta.loader import batch_commit, hotswap  # noqa: E402

ALL_DTYPES = [d.torch_dtype for d in _dtypes.BY_NAME.values()]


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _special_bits(dt: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` random elements of ``dt`` with NaN payloads (either sign), -0.0, +0.0, infinities and subnormals."""
    w = torch.empty(0, dtype=dt).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, n * w, dtype=np.uint8)
    if dt == torch.bool:
        return torch.from_numpy(raw[:n] & 1).to(torch.bool)
    t = torch.from_numpy(raw).view(dt).clone()
    if dt.is_floating_point:
        t[0::7] = -0.0
        t[1::7] = 0.0
        t[2::11] = float("inf")
        t[4::13] = torch.finfo(dt).smallest_normal / 4             # a subnormal (fp8 e4m3 has some too)
        bits = t.view(_INTS[w])
        nan = int(torch.tensor(float("nan"), dtype=dt).view(_INTS[w]))
        bits[3::11] = nan
        if w > 1:
            bits[5::17] = nan ^ 1                                  # other payloads, and negative NaNs
            bits[6::19] = (nan ^ 2) | (-1 << (8 * w - 1))
    return t


def _changed(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """``t`` with about ``frac`` of its elements given other bits: their sign flipped (-0.0 <-> +0.0, NaN
    signs) or low bits changed (NaN payload -> another payload, subnormals, ...)."""
    rng = np.random.default_rng(seed)
    new = t.clone()
    flat = new.view(-1)
    idx = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < frac))
    if t.dtype == torch.bool:
        flat[idx] = ~flat[idx]
        return new
    w = t.element_size()
    bits = flat.view(_INTS[w])
    half = idx[: idx.numel() // 2]
    bits[half] = bits[half] ^ (-1 << (8 * w - 1)) if w > 1 else bits[half] ^ 0x80
    rest = idx[idx.numel() // 2:]
    bits[rest] = bits[rest] ^ torch.from_numpy(rng.integers(1, 127, rest.numel())).to(_INTS[w])
    return new


@pytest.fixture
def every_dtype_run(tmp_path):
    """Versions 0-2 of one tensor per dtype (specials included), ~2% then ~12% of each one's elements changed."""
    v0 = {f"t.{str(dt).split('.')[-1]}": _special_bits(dt, 3000, i).reshape(30, 100) for i, dt in enumerate(ALL_DTYPES)}
    v1 = {k: _changed(t, 0.02, 100 + i) for i, (k, t) in enumerate(v0.items())}
    v2 = {k: _changed(t, 0.12, 200 + i) for i, (k, t) in enumerate(v1.items())}
    return write_run(str(tmp_path / "dtypes"), versions=[v0, v1, v2])


@pytest.mark.parametrize("mode", ["scatter", "copy", "auto"])
def test_each_commit_mode_is_bit_exact_for_every_dtype_nan_payloads_and_signed_zeros(every_dtype_run, mode):
    run = every_dtype_run
    live, sw = swapper_at(run, 0, commit_mode=mode)
    for v in (1, 2, 0, 2, 1):                   # forward, back through the anchor, and again
        prepared = sw.prepare(v)
        sparse = sum(1 for s in prepared.staged if s.st.dense is None)
        dense = len(prepared.staged) - sparse                # swapped whole whatever the mode
        assert all(s.choice is not None for s in prepared.staged)    # every one in the batch
        # tiny tensors: auto scatters the sparse ones
        assert prepared.report.tensors_copied == dense + (sparse if mode == "copy" else 0), (mode, v)
        assert sw.commit(prepared).tensors_copied == prepared.report.tensors_copied
        assert_at(live, run, v)


def test_auto_copies_the_tensors_changed_past_the_threshold_and_scatters_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_commit, "COPY_ABOVE", {w: 0.05 for w in batch_commit.COPY_ABOVE})
    n = batch_commit.MIN_COPY_BYTES // 2        # bf16: exactly the smallest tensor auto may copy
    v0 = {"few": _special_bits(torch.bfloat16, n, 1), "many": _special_bits(torch.bfloat16, n, 2),
          "small": _special_bits(torch.bfloat16, 1000, 3)}
    v1 = {"few": _changed(v0["few"], 0.01, 4), "many": _changed(v0["many"], 0.10, 5),
          "small": _changed(v0["small"], 0.10, 6)}
    run = write_run(str(tmp_path / "auto"), versions=[v0, v1], chunk_elems=1 << 16)
    live, sw = swapper_at(run, 0)
    prepared = sw.prepare(1)
    modes = {s.name: s.choice.mode for s in prepared.staged}
    assert modes == {"few": 0, "many": 1, "small": 0}           # MODE_SCATTER, MODE_COPY, too small to copy
    assert prepared.report.tensors_copied == 1
    assert prepared.staging_bytes >= 2 * n                    # the staged whole copy of "many"
    sw.commit(prepared)
    assert_at(live, run, 1)
    sw.hotload(0)
    assert_at(live, run, 0)


@pytest.fixture(params=["team", "threads"])
def runner(request, monkeypatch):
    """Who writes a batch of two threads: torch's OpenMP team (ckptdelta.delta.omp) or the commit's own threads."""
    if request.param == "threads":
        monkeypatch.setattr(batch_commit.omp, "team", lambda: None)
    elif batch_commit.omp.team() is None:
        pytest.skip("torch runs on no OpenMP runtime here")
    monkeypatch.setattr(batch_commit, "THREADS_ABOVE_NS", 0.0)
    monkeypatch.setattr(batch_commit, "TEAM_ABOVE_NS", 0.0)
    monkeypatch.setattr(batch_commit, "TASK_ELEMS", 8)        # many small tasks, shared out to two threads
    return request.param


@pytest.mark.parametrize("mode", ["scatter", "copy"])
@pytest.mark.parametrize("where", ["changed", "unchanged", "swapped"])
def test_a_batched_tensor_written_after_prepare_is_refused_in_either_mode_and_every_write_kept(run, mode, where,
                                                                                             runner, monkeypatch):
    """The refusal may come from either commit thread: every tensor either thread wrote is put back. The last
    batched tensor of a kind is written by a range claimed after the first two (each thread starts on one of
    those). "swapped": a write into a densely staged tensor, which the batch swaps whole in either mode."""
    monkeypatch.setattr(batch_commit, "TASK_BLOCKS", 1)
    live, sw = swapper_at(run, 0, commit_mode=mode, stage_threads=2)
    prepared = sw.prepare(1)
    assert prepared.batch is not None and prepared.batch.threads == 2 and prepared.batch.runner == runner
    dense = where == "swapped"
    s = [s for s in prepared.staged if s.choice is not None and (s.st.dense is not None) == dense][-1]
    ranges = prepared.batch.ranges
    assert len(ranges) > 2 and ranges[-1][0] == len(prepared.batch.groups) - 1
    flat = live[s.live_name].view(-1).view(_INTS[live[s.live_name].element_size()])
    if where == "changed":
        pos = int(s.st.positions[len(s.st.positions) // 2])
    elif where == "unchanged":
        pos = int(next(i for i in range(flat.numel()) if i not in set(s.st.positions.tolist())))
    else:
        assert s.choice.mode == batch_commit.kernels.MODE_SWAP
        pos = flat.numel() - 1
    flat[pos] ^= 1                                             # another writer, in place
    written = clone(live)
    if mode == "scatter" and where == "unchanged":             # not seen: the scatter checks what it writes
        sw.commit(prepared)
        assert sw.version == 1
        return
    if mode == "scatter" and not dense:                        # the message names the element or its block
        what = f"element {pos} "
    else:
        be = batch_commit.block_elems(flat.element_size())
        what = f"elements [{pos // be * be}, "
    with pytest.raises(HotLoadError, match=f"{s.name!r}: {re.escape(what)}.*written after prepare"):
        sw.commit(prepared)
    assert sw.version == 0
    for k in live:
        assert bits_equal(live[k], written[k]), k
    flat[pos] ^= 1                                             # the other writer undoes its write
    sw.commit(prepared)                                        # and the prepared update is still whole
    assert_at(live, run, 1)


@pytest.mark.parametrize("mode", ["scatter", "copy"])
def test_a_failure_after_the_batch_puts_back_every_batched_tensor(mixed_run, mode, monkeypatch):
    """The batch (the contiguous tensors, sparse and dense) writes first; a strided dense tensor refused
    afterwards rolls the batch back, its swapped tensors swapped back, and the update commits again."""
    run = mixed_run
    calls = []
    for verb in ("run", "undo"):
        real = getattr(batch_commit.CommitBatch, verb)
        monkeypatch.setattr(batch_commit.CommitBatch, verb,
                            lambda self, real=real, verb=verb: (calls.append(verb), real(self))[1])
    live = {k: strided_copy(t) if k == "dense.0" else t.clone() for k, t in run.truth[0].items()}
    sw = HotSwapper(live, SnapshotReader(run.url), version=0, commit_mode=mode)
    prepared = sw.prepare(1)
    assert {s.live_name for s in prepared.staged if s.choice is not None} == {"sparse.0", "sparse.1", "dense.1"}
    live["dense.0"][-1, -1] = 7.0                             # another writer, in the strided dense tensor
    written = clone(live)
    with pytest.raises(HotLoadError, match=r"'dense.0'.*written after prepare.*tensors already written were rest"):
        sw.commit(prepared)
    assert calls == ["run", "undo"] and sw.version == 0
    for k in live:
        assert bits_equal(live[k], written[k]), k
    live["dense.0"].copy_(run.truth[0]["dense.0"])
    sw.commit(prepared)
    assert_at(live, run, 1)


def _fail_the_step_after_the_batch_once(monkeypatch) -> None:
    """The commit's first _synchronize (right after the batch) raises; the rollback's then runs as usual."""
    real, calls = hotswap._synchronize, []

    def fail_once(undo):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        real(undo)

    monkeypatch.setattr(hotswap, "_synchronize", fail_once)


def test_a_densely_changed_tensor_is_swapped_by_the_batch_and_its_staged_bits_become_the_undo(mixed_run,
                                                                                             monkeypatch):
    """A contiguous dense change is one more batch item (no chunk-by-chunk swap in Python inside the pause):
    after the commit the staged array holds the old bits; a failure after the batch swaps them back, so the
    same prepared update commits again, bit-exact."""
    run = mixed_run
    live = {k: t.clone() for k, t in run.truth[0].items()}
    sw = HotSwapper(live, SnapshotReader(run.url), version=0)
    prepared = sw.prepare(1)
    swapped = {s.live_name: s for s in prepared.staged if s.st.dense is not None}
    assert set(swapped) == {"dense.0", "dense.1"}
    assert all(s.choice.mode == batch_commit.kernels.MODE_SWAP and s.choice.whole.base is not None
               for s in swapped.values())                     # a view of the staged array itself: no copy
    assert prepared.report.tensors_copied == 2
    staged = {k: s.st.dense.copy() for k, s in swapped.items()}
    _fail_the_step_after_the_batch_once(monkeypatch)
    with pytest.raises(HotLoadError, match="RuntimeError: injected.*restored"):
        sw.commit(prepared)
    assert_at(live, run, 0)
    for k, s in swapped.items():
        np.testing.assert_array_equal(s.st.dense, staged[k])   # the new bits again
    monkeypatch.undo()
    sw.commit(prepared)
    assert_at(live, run, 1)
    for k, s in swapped.items():                               # the old bits, where the swap left them
        np.testing.assert_array_equal(s.st.dense, _dtypes.host_bits(run.truth[0][k]))


def test_densely_changed_tensors_of_many_blocks_are_swapped_by_both_threads_and_put_back_whole(tmp_path, runner,
                                                                                                 monkeypatch):
    """Two dense changes of 32 blocks each, one task a block, on two threads (ranges claimed by whichever is
    free): a write after prepare in a later
    block of one is refused with every block of both put back (the staged arrays holding the new bits again),
    then the update commits bit-exact and leaves the old bits staged; a failure after the batch swaps them back."""
    monkeypatch.setattr(batch_commit, "TASK_BLOCKS", 1)
    g = torch.Generator().manual_seed(11)
    v0 = {k: torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for k in ("a", "b")}
    v1 = {k: t + 1.0 for k, t in v0.items()}
    run = write_run(str(tmp_path / "dense"), versions=[v0, v1])
    live = clone(run.truth[0])
    sw = HotSwapper(live, SnapshotReader(run.url), version=0, stage_threads=2)
    prepared = sw.prepare(1)
    batch = prepared.batch
    assert batch.threads == 2 and batch.runner == runner and len(batch.ranges) > 4
    assert {s.live_name: s.choice.mode for s in prepared.staged} == {"a": 2, "b": 2}   # MODE_SWAP
    staged = {s.live_name: s.st.dense for s in prepared.staged}
    new_bits = {k: _dtypes.host_bits(run.truth[1][k]).copy() for k in live}
    old_bits = {k: _dtypes.host_bits(run.truth[0][k]).copy() for k in live}
    be = batch_commit.block_elems(2)
    where = 20 * be + 5                                        # the 21st block of "b"
    live["b"].view(-1)[where] = 7.0                            # another writer, after prepare
    written = clone(live)
    with pytest.raises(HotLoadError, match=rf"'b': elements \[{20 * be}, {21 * be}\).*written after prepare"):
        sw.commit(prepared)
    assert sw.version == 0 and set(batch.tables.results[:, 0].tolist()) <= {0, 1, -1}
    for k in live:
        assert bits_equal(live[k], written[k]), k
        np.testing.assert_array_equal(staged[k], new_bits[k])
    live["b"].copy_(run.truth[0]["b"])
    sw.commit(prepared)
    assert_at(live, run, 1)
    assert set(batch.tables.results[:, 0].tolist()) <= {0, 1}  # either thread, whichever claimed first
    for k in live:
        np.testing.assert_array_equal(staged[k], old_bits[k])  # the undo, where the swap left it
    back = sw.prepare(0)
    _fail_the_step_after_the_batch_once(monkeypatch)
    with pytest.raises(HotLoadError, match="RuntimeError: injected.*restored"):
        sw.commit(back)
    assert sw.version == 1
    assert_at(live, run, 1)
    sw.commit(back)
    assert_at(live, run, 0)


def test_every_range_of_a_batch_is_written_once_by_whichever_thread_claims_it(run, runner):
    live, sw = swapper_at(run, 0, stage_threads=2)
    for v in (1, 0, 1):
        prepared = sw.prepare(v)
        batch = prepared.batch
        assert batch.threads == 2 and batch.runner == runner and len(batch.ranges) >= 4
        sw.commit(prepared)
        assert_at(live, run, v)
        who, done = batch.tables.results[:, 0], batch.tables.results[:, 1]
        assert set(who.tolist()) <= {0, 1}
        assert done.tolist() == [t1 - t0 for _g, t0, t1 in batch.ranges]


@pytest.mark.parametrize("runner", ["threads"], indirect=True)
def test_a_commit_thread_that_comes_late_leaves_the_ranges_to_the_one_that_came(run, runner, monkeypatch):
    """The commit's threads claim task ranges as they finish the last: one that stalls (a busy core) holds up
    none of them, and the batch is still written whole and bit-exact."""
    real = batch_commit._claim_and_write

    def late_in_the_pool(ctl):
        if threading.current_thread().name.startswith("ckptdelta-commit"):
            time.sleep(0.3)
        real(ctl)

    monkeypatch.setattr(batch_commit, "_claim_and_write", late_in_the_pool)
    live, sw = swapper_at(run, 0, stage_threads=2)
    prepared = sw.prepare(1)
    batch = prepared.batch
    sw.commit(prepared)
    assert_at(live, run, 1)
    assert batch.tables.results[:, 0].tolist() == [0] * len(batch.ranges)   # every range the caller's


@pytest.mark.parametrize("runner", ["threads"], indirect=True)
def test_an_error_inside_a_commit_thread_puts_back_what_every_thread_wrote(run, runner, monkeypatch):
    calls = []
    real = batch_commit._claim_and_write

    def failing(ctl):
        calls.append(threading.current_thread().name)
        if not threading.current_thread().name.startswith("ckptdelta-commit"):
            return real(ctl)
        raise MemoryError("injected in a commit thread")

    monkeypatch.setattr(batch_commit, "_claim_and_write", failing)
    live, sw = swapper_at(run, 0, stage_threads=2)
    prepared = sw.prepare(1)
    with pytest.raises(HotLoadError, match="MemoryError.*restored"):
        sw.commit(prepared)
    assert any(c.startswith("ckptdelta-commit") for c in calls)
    assert sw.version == 0
    assert_at(live, run, 0)
    monkeypatch.setattr(batch_commit, "_claim_and_write", real)
    sw.commit(prepared)
    assert_at(live, run, 1)
