"""An FSDP2 job on 2 ranks (gloo, CPU) publishes every step from its DTensors, and replicas load every version.

One real job serves every test here (a module fixture, so the ranks' imports are paid once): a tiny Llama
(transformers' class, bf16, vocabulary 101 and MLP width 37, so ``Shard(0)`` leaves an uneven last shard)
``fully_shard``-ed on a 2-rank CPU mesh, trained with AdamW, published after every step from
``model.state_dict()``: DTensors. Odd modules: an unused ``value_head`` whose weight FSDP2 shards as
``Shard(1)`` (``shard_placement_fn``) and whose bits the job sets to NaNs with payloads and -0.0, and a
``Replicate`` DTensor (``distribute_tensor``) published beside the state dict. Each rank encodes only its own
boxes; the truth of every version is what ``full_tensor()`` gathers (for the test only). The job then
restarts its publishers (same mesh: the parents are rebuilt from the bucket, box by box) and publishes once
more, and finally rank 1 is SIGKILLed during a publish, after uploading its delta object.
"""

from __future__ import annotations

import datetime
import itertools
import json
import multiprocessing
import os
import signal
import struct

import numpy as np
import pytest
import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.errors import PublishError
from ckptdelta.delta.manifest import manifest_key
from ckptdelta.delta.storage import Store
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher, collect
from ckptdelta.publisher.runs import committed_versions
from tests.delta.test_records import format_md_decode

WORLD = 2
STEPS = 6                 # anchor, delta x3, anchor (anchor_every=4), delta
SHARD_BYTES = 3000


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=101, hidden_size=20, intermediate_size=37, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                       max_position_embeddings=64)


def _odd_bits(step: int, rank: int) -> list[tuple[int, int, int]]:
    """(row, column, bf16 bits) the job writes into its local shard of value_head.weight at ``step``."""
    return [(0, 0, 0x7F81 + step), (1, 1, 0x8000), (2, 3 + rank, 0xFFC5 - step)]


def _rank_main(rank: int, init_file: str, url: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).to(torch.bfloat16)
    model.value_head = torch.nn.Linear(20, 3, dtype=torch.bfloat16)     # not in the loss: AdamW leaves it be
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p is model.value_head.weight else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    temp = torch.tensor([1.0, -0.0, float("nan"), 0.5, 2.0], dtype=torch.bfloat16)

    def state(step: int) -> dict:
        with torch.no_grad():
            local = model.value_head.weight.to_local()
            bits = local.view(torch.int16)
            for i, j, b in _odd_bits(step, rank):
                bits[i, j] = b - (1 << 16) if b >= 1 << 15 else b
            temp[0] = 1.0 + step / 8
        return {**model.state_dict(), "extra.temperature": distribute_tensor(temp, mesh, [Replicate()])}

    def truth(sd: dict, version: int) -> None:
        full = {n: t.full_tensor() for n, t in sd.items()}       # the test's truth: a gather, test only
        if rank == 0:
            torch.save(full, os.path.join(out_dir, f"truth-{version}.pt"))

    results: list = []
    step = 0
    with Publisher(url, anchor_every=4, anchor_chain_fraction=10.0, shard_bytes=SHARD_BYTES, codec="context",
                   progress=False) as pub:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            ids = torch.randint(0, 101, (2, 12), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            sd = state(step)
            before = dict(pub._comm.stats)
            r = pub.publish(sd, step)
            truth(sd, r.version)
            results.append({"version": r.version, "kind": r.kind, "reason": r.reason, "changed": r.n_changed_tensors,
                            "stored": r.stored_bytes, "full": r.full_bytes,
                            "tensor_bytes": pub._comm.stats["tensor_bytes"] - before["tensor_bytes"],
                            "object_bytes": pub._comm.stats["object_bytes"] - before["object_bytes"]})
    # A restarted job on the same mesh: each rank rebuilds only its own boxes of the parent from the bucket.
    with Publisher(url, anchor_every=4, anchor_chain_fraction=10.0, codec="context", progress=False) as pub:
        sd = state(STEPS)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(1.0078125)
        r = pub.publish(sd, STEPS)
        truth(sd, r.version)
        results.append({"version": r.version, "kind": r.kind, "reason": r.reason, "changed": r.n_changed_tensors,
                        "tensor_bytes": pub._comm.stats["tensor_bytes"]})
        # Rank 1 dies during the next publish, once its delta object is uploaded, before the commit.
        if rank == 1:
            put_file = pub.store.put_file

            def die_after(key: str, path: str) -> None:
                put_file(key, path)
                os.kill(os.getpid(), signal.SIGKILL)
            pub.store.put_file = die_after
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(1.0078125)
        try:
            pub.publish(state(STEPS + 1), STEPS + 1)
            results.append("published")
        except PublishError as e:
            results.append(f"{type(e).__name__}: {e}")
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    os._exit(0)                      # without the process group's teardown, which would wait for the dead peer


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    url = str(d / "run")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, str(d / "init"), url, str(d))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    assert codes == [0, -signal.SIGKILL], f"rank exit codes {codes}"
    results = json.load(open(d / "rank0.json"))
    truth = {v: torch.load(d / f"truth-{v}.pt") for v in range(STEPS + 1)}
    return url, results, truth


def _bits(t: torch.Tensor) -> np.ndarray:
    return dtypes.host_bits(t.contiguous())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and np.array_equal(_bits(a), _bits(b))


def test_a_two_rank_fsdp2_job_publishes_every_step_from_dtensors_gathering_nothing_for_a_delta(fsdp_run):
    url, results, truth = fsdp_run
    steps = results[:STEPS]
    assert [r["kind"] for r in steps] == ["anchor", "delta", "delta", "delta", "anchor", "delta"]
    for r in steps:
        if r["kind"] == "delta":        # metadata only: schemas, boxes, entries; no tensor bytes at all
            assert r["tensor_bytes"] == 0 and 0 < r["object_bytes"] < 40_000 and r["changed"] > 10
        else:                           # an anchor gathers each pieced tensor into the rank writing its shard
            assert 0 < r["tensor_bytes"] < r["full"]
    restart = results[STEPS]
    assert restart["kind"] == "delta" and restart["version"] == STEPS and restart["tensor_bytes"] == 0
    reader = SnapshotReader(url)
    m = reader.manifest(1)
    raw = json.loads(reader.store.get(manifest_key(1)))
    assert raw["schema_version"] == 2
    embed = m.tensors["model.embed_tokens.weight"]          # 101 rows: 51 + 50
    assert [p.box for p in embed.pieces] == [((0, 0), (51, 20)), ((51, 0), (50, 20))]
    head = m.tensors["value_head.weight"]                   # Shard(1): columns
    assert [p.box for p in head.pieces] == [((0, 0), (3, 10)), ((0, 10), (3, 10))]
    gate = m.tensors["model.layers.0.mlp.gate_proj.weight"]  # 37 rows: 19 + 18
    assert [p.shape[0] for p in gate.pieces] == [19, 18]
    temp = m.tensors["extra.temperature"]                   # Replicate: each rank encodes its share of rows
    assert [p.box for p in temp.pieces] == [((0,), (3,)), ((3,), (2,))]
    # anchors are whole tensors in HF shards: a checkpoint directory transformers loads as it is
    anchor = reader.manifest(4)
    assert all(not e.pieces for e in anchor.tensors.values())
    shards = [o.key for o in anchor.objects if o.key.endswith(".safetensors")]
    assert len(shards) > 2
    index = json.loads(reader.store.get(next(o.key for o in anchor.objects if o.key.endswith("index.json"))))
    assert sorted(index["weight_map"]) == sorted(truth[4])
    from safetensors.torch import load_file
    got = {}
    for key in shards:
        got.update(load_file(os.path.join(url, key)))
    assert sorted(got) == sorted(truth[4]) and all(_same(got[n], truth[4][n]) for n in got)


def test_replicas_hot_load_every_version_bit_exact_forward_across_anchors_and_back(fsdp_run):
    url, _results, truth = fsdp_run
    reader = SnapshotReader(url)
    assert reader.latest() == STEPS          # the killed publish committed nothing
    live = {n: t.clone() for n, t in reader.read_tensors(0).items()}
    swapper = HotSwapper(live, reader, version=0, stage_threads=1)
    for v in [*range(1, STEPS + 1), 2, 0, 5, 3]:
        swapper.hotload(v)
        bad = [n for n in truth[v] if not _same(live[n], truth[v][n])]
        assert not bad, f"v{v}: {bad[:3]}"
    w = live["value_head.weight"].view(torch.int16)        # NaN payloads and -0.0, bit for bit
    assert [int(w[0, 0]) & 0xFFFF, int(w[1, 1]) & 0xFFFF, int(w[2, 14]) & 0xFFFF] == [0x7F84, 0x8000, 0xFFC2]
    for v in (STEPS, 3):                                    # a fresh reader assembles the same, and verify passes
        assert all(_same(t, truth[v][n]) for n, t in SnapshotReader(url).read_tensors(v).items())
    report = reader.verify(STEPS)
    assert report.chain == [4, 5, 6]


def test_a_reader_written_from_format_md_assembles_a_pieced_delta(fsdp_run):
    """FORMAT.md "Pieces" alone (json, struct, xxhash, numpy; records through test_records' FORMAT.md reader)."""
    url, _results, truth = fsdp_run
    v = 2
    doc = json.loads(open(os.path.join(url, "manifests", f"{v:012d}.json"), "rb").read())
    assert doc["schema_version"] == 2
    pieced = 0
    for name, e in doc["tensors"].items():
        parent = _bits(truth[v - 1][name]).reshape(truth[v - 1][name].shape)
        new = parent.copy()
        if "pieces" not in e:
            continue
        pieced += 1
        assert e["object"] is None and e["offset"] == e["length"] == 0
        shape = e["shape"]
        ndim = len(shape)
        cuts = e["pieces"]["cuts"]                          # the grid's cells, in C order of their coordinates
        assert [(c[0], c[-1]) for c in cuts] == [(0, n) for n in shape]
        spans = [[(c[i], c[i + 1] - c[i]) for i in range(len(c) - 1)] for c in cuts]
        cols = e["pieces"]
        ps = [{"offsets": [o for o, _ in cell], "shape": [n for _, n in cell], "xxh3": cols["xxh3"][k],
               "object": cols["object"][k], "offset": cols["offset"][k], "length": cols["length"][k]}
              for k, cell in enumerate(itertools.product(*spans))]
        blob = b"CKDPIECE" + struct.pack("<II", ndim, len(ps)) + b"".join(
            struct.pack(f"<{2 * ndim + 1}Q", *p["offsets"], *p["shape"], int(p["xxh3"], 16)) for p in ps)
        assert f"{xxhash.xxh3_64_intdigest(blob):016x}" == e["xxh3"]
        for p in ps:
            box = tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["shape"]))
            if p["object"] is None:
                continue
            obj = doc["objects"][p["object"]]
            with open(os.path.join(url, obj["key"]), "rb") as f:
                f.seek(p["offset"])
                record = f.read(p["length"])
            fields, bits = format_md_decode(record, np.ascontiguousarray(parent[box]).reshape(-1))
            assert fields["name"] == name and list(fields["shape"]) == p["shape"]
            new[box] = bits.reshape(p["shape"])
        for p in ps:                                        # the assembled tensor, proven box by box
            box = tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["shape"]))
            assert f"{xxhash.xxh3_64_intdigest(np.ascontiguousarray(new[box])):016x}" == p["xxh3"]
        assert np.array_equal(new.reshape(-1), _bits(truth[v][name]))
    assert pieced >= 15


def test_a_rank_killed_mid_publish_fails_the_other_and_leaves_the_run_readable(fsdp_run):
    url, results, truth = fsdp_run
    # a CollectiveError (a PublishError): the publishers' collective itself failed, not a rank's own step
    assert results[-1].startswith("CollectiveError: rank 0: the publishers'") and "commits nothing" in results[-1]
    store = Store.from_url(url)
    assert committed_versions(store) == list(range(STEPS + 1))
    debris = [k for k in store.list_prefix("deltas/") if k.startswith(f"deltas/{STEPS + 1:012d}-")]
    assert any(k.endswith("rank-00001.ckd") for k in debris)     # rank 1 uploaded, then died: never committed
    reader = SnapshotReader(url)
    assert reader.latest() == STEPS and reader.verify().chain == [4, 5, 6]
    assert all(_same(t, truth[STEPS][n]) for n, t in reader.read_tensors("latest").items())
    collect(url, keep_anchors=2, grace_seconds=0)
    assert not [k for k in store.list_prefix("deltas/") if k.startswith(f"deltas/{STEPS + 1:012d}-")]
    assert all(_same(t, truth[STEPS][n]) for n, t in SnapshotReader(url).read_tensors("latest").items())


def test_resuming_on_one_rank_anchors_where_the_pieces_change_then_deltas(fsdp_run, caplog):
    url, _results, truth = fsdp_run
    w = {n: t.clone() for n, t in truth[STEPS].items()}
    with Publisher(url, anchor_chain_fraction=10.0, codec="context", progress=False) as pub:
        w["model.norm.weight"] += 1
        r = pub.publish(w, STEPS + 1)
        assert (r.version, r.kind) == (STEPS + 1, "anchor") and "other pieces" in r.reason
        w["model.norm.weight"] += 1
        r2 = pub.publish(w, STEPS + 2)
        assert r2.kind == "delta" and r2.n_changed_tensors == 1
    reader = SnapshotReader(url)
    assert all(_same(t, w[n]) for n, t in reader.read_tensors(r2.version).items())
    assert all(not e.pieces for e in reader.manifest(r2.version).tensors.values())
