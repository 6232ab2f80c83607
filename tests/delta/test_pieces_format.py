"""Pieced tensors (docs/FORMAT.md, "Pieces"): the grid rule, the digest of pieces, the manifest's checks, and every
reader assembling them: read_tensors, the hot swap, verify, materialize, and the publisher's own rebuild.

The 2-rank job (tests/publisher/test_sharded_publish.py) writes real pieced deltas of row and column boxes; here deltas are
written straight from the format modules, one object per box as one rank per box would, so the cases it cannot
reach cheaply are covered too: a 2-D grid of blocks, a box the manifest calls unchanged whose bits changed,
hostile manifests.
"""

from __future__ import annotations

import io
import json
import os
import struct

import numpy as np
import pytest
import torch
import xxhash

from ckptdelta.delta import dtypes, encode
from ckptdelta.delta.container import ObjectWriter
from ckptdelta.delta.errors import ChecksumError, ManifestError, ParentMismatchError, PublishError, PublishInputError
from ckptdelta.delta.manifest import Manifest, ObjectRef, TensorEntry, delta_prefix, manifest_key
from ckptdelta.delta.pieces import PieceEntry, grid_problem, pieces_digest, tensor_digest
from ckptdelta.delta.storage import Store
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from ckptdelta.publisher.rebuild import read_chain, rebuild, rebuild_boxes
from ckptdelta.publisher.runs import commit, read_manifest
from ckptdelta.publisher.sharded import LocalBox, plan_union

GRID_2X2 = [((0, 0), (3, 4)), ((0, 4), (3, 5)), ((3, 0), (2, 4)), ((3, 4), (2, 5))]   # a 5 x 9 tensor
ROWS = [((0, 0), (4, 6)), ((4, 0), (3, 6))]                                            # a 7 x 6 tensor


def _bits(t: torch.Tensor) -> np.ndarray:
    return dtypes.host_bits(t.contiguous())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and np.array_equal(_bits(a), _bits(b))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"grid": torch.randn(5, 9, generator=g).bfloat16(), "rows": torch.randn(7, 6, generator=g),
         "plain": torch.randn(4, generator=g).half()}
    b = w["grid"].view(torch.int16)
    b[0, 8], b[4, 0] = 0x7F85, -0x8000                     # a NaN with a payload, -0.0 (in two different boxes)
    return w


def _step(w: dict[str, torch.Tensor], seed: int, *, keep: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """The next version: elements moved by one ulp, except in the boxes of "grid" listed in ``keep``."""
    out = {n: t.clone() for n, t in w.items()}
    rng = np.random.default_rng(seed)
    for n, t in out.items():
        bits = _bits(t).reshape(t.shape) if t.is_contiguous() else None
        idx = tuple(rng.integers(0, s, 6) for s in t.shape)
        bits[idx] += 1
    for k in keep:
        (o, s) = GRID_2X2[k]
        box = tuple(slice(a, a + b) for a, b in zip(o, s))
        out["grid"][box] = w["grid"][box]
    out["grid"].view(torch.int16)[0, 8] = 0x7F85 + seed % 7
    return out


def _pieced_delta(store: Store, m_prev: Manifest, prev: dict, new: dict, version: int,
                  boxes: dict[str, list], *, claim_unchanged: tuple = ()) -> Manifest:
    """A delta manifest as a sharded publisher writes it: each box's record in the object of the rank holding it,
    the other tensors whole in rank 0's. ``claim_unchanged``: (name, piece) listed unchanged whatever its bits."""
    writers = [io.BytesIO() for _ in range(max(len(b) for b in boxes.values()))]
    objs = [ObjectWriter(f) for f in writers]
    entries: dict[str, TensorEntry] = {}
    for name, t in new.items():
        if name not in boxes:
            off, ln = objs[0].add(name, encode(prev[name], t, name=name).to_bytes())
            entries[name] = TensorEntry(dtypes.of(t).name, tuple(t.shape), _xxh(t), 0, off, ln)
            continue
        parts = []
        for k, (o, s) in enumerate(boxes[name]):
            sl = tuple(slice(a, a + b) for a, b in zip(o, s))
            old_box, new_box = prev[name][sl].contiguous(), t[sl].contiguous()
            if _same(old_box, new_box) or (name, k) in claim_unchanged:
                parts.append(PieceEntry(o, s, _xxh(new_box), None))
                continue
            off, ln = objs[k].add(name, encode(old_box, new_box, name=name).to_bytes())
            parts.append(PieceEntry(o, s, _xxh(new_box), k, off, ln))
        entries[name] = TensorEntry(dtypes.of(t).name, tuple(t.shape), pieces_digest(parts), None, 0, 0, tuple(parts))
    refs = []
    for k, (ow, f) in enumerate(zip(objs, writers)):
        ow.finish()
        key = f"{delta_prefix(version, 'handmade')}/rank-{k:05d}.ckd"
        store.put(key, f.getvalue())
        refs.append(ObjectRef(key, len(f.getvalue()), _xxh_bytes(f.getvalue())))
    m = Manifest(run_id=m_prev.run_id, version=version, kind="delta", parent_version=m_prev.version,
                 anchor_version=m_prev.anchor_version, created="2025-01-01T00:00:00Z", step=version,
                 writer_id="handmade", objects=tuple(refs), tensors=entries)
    Manifest.from_json(m.to_json())
    commit(store, m)
    return m


def _xxh(t: torch.Tensor) -> str:
    return f"{xxhash.xxh3_64_intdigest(_bits(t)):016x}"


def _xxh_bytes(b: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(b):016x}"


@pytest.fixture
def pieced_run(tmp_path):
    """v0 an anchor (whole), v1 and v2 pieced deltas (a 2 x 2 grid of blocks, two row ranges), v2 leaving one
    block unchanged."""
    url = str(tmp_path / "run")
    truth = {0: _weights(0)}
    with Publisher(url, progress=False, codec="fast") as pub:
        pub.publish(truth[0], 0)
    store = Store.from_url(url)
    boxes = {"grid": GRID_2X2, "rows": ROWS}
    m = read_manifest(store, 0, None)
    for v in (1, 2):
        truth[v] = _step(truth[v - 1], v, keep=(2,) if v == 2 else ())
        m = _pieced_delta(store, m, truth[v - 1], truth[v], v, boxes)
    return url, store, truth


def test_pieces_digest_is_xxh3_of_the_documented_bytes():
    ps = [PieceEntry((0, 0), (3, 4), "00000000000000aa", 0, 8, 100),
          PieceEntry((3, 0), (2, 4), "ffffffffffffffff", None)]
    blob = b"CKDPIECE" + struct.pack("<II", 2, 2) + struct.pack("<5Q", 0, 0, 3, 4, 0xAA) + \
        struct.pack("<5Q", 3, 0, 2, 4, 0xFFFFFFFFFFFFFFFF)
    assert pieces_digest(ps) == f"{xxhash.xxh3_64_intdigest(blob):016x}"
    t = torch.arange(20, dtype=torch.int32).reshape(5, 4)
    want = pieces_digest([((0, 0), (3, 4), xxhash.xxh3_64_intdigest(_bits(t[:3]))),
                          ((3, 0), (2, 4), xxhash.xxh3_64_intdigest(_bits(t[3:])))])
    assert tensor_digest(ps, t) == want and tensor_digest((), t) == _xxh(t)


@pytest.mark.parametrize("shape, boxes, problem", [
    ((101, 20), [((0, 0), (51, 20)), ((51, 0), (50, 20))], None),                      # Shard(0), uneven
    ((3, 20), [((0, 0), (3, 10)), ((0, 10), (3, 10))], None),                          # Shard(1)
    ((5, 9), GRID_2X2, None),                                                          # a 2-D mesh's blocks
    ((6,), [((0,), (2,)), ((2,), (2,)), ((4,), (2,))], None),
    ((6,), [((0,), (3,)), ((2,), (4,))], "spans several cells"),                        # overlap
    ((6,), [((0,), (2,)), ((3,), (3,))], "do not cover"),                               # a gap
    ((6,), [((3,), (3,)), ((0,), (3,))], "increasing order"),
    ((6,), [((0,), (3,)), ((0,), (3,)), ((3,), (3,))], "increasing order"),             # twice
    ((6,), [((0,), (3,)), ((3,), (4,))], "outside"),
    ((6,), [((0,), (6,))], "at least 2"),
    ((), [((), ()), ((), ())], "scalar"),
    # covers every element once, but not as a grid: the second row of blocks is cut elsewhere
    ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 3)), ((2, 3), (2, 1))], "spans several cells"),
])
def test_pieces_must_tile_the_tensor_as_a_grid_in_order(shape, boxes, problem):
    got = grid_problem(shape, boxes)
    assert got is None if problem is None else problem in got


def _manifest_json() -> dict:
    ps = [PieceEntry((0, 0), (4, 6), "00000000000000aa", 0, 8, 100),
          PieceEntry((4, 0), (3, 6), "00000000000000bb", None)]
    m = Manifest(run_id="r", version=1, kind="delta", parent_version=0, anchor_version=0, created="x", step=1,
                 writer_id="w", objects=(ObjectRef("deltas/000000000001-w/rank-00000.ckd", 4096, "0" * 16),),
                 tensors={"rows": TensorEntry("F32", (7, 6), pieces_digest(ps), None, 0, 0, tuple(ps))})
    return json.loads(m.to_json())


def test_a_manifest_with_pieces_round_trips_as_schema_version_2_and_one_without_stays_1():
    d = _manifest_json()
    assert d["schema_version"] == 2 and d["tensors"]["rows"]["pieces"] == {
        "cuts": [[0, 4, 7], [0, 6]], "xxh3": ["00000000000000aa", "00000000000000bb"], "object": [0, None],
        "offset": [8, 0], "length": [100, 0]}
    m = Manifest.from_json(json.dumps(d).encode())
    assert m.tensors["rows"].pieces[0].box == ((0, 0), (4, 6)) and Manifest.from_json(m.to_json()) == m
    plain = json.loads(Manifest(**{**m.__dict__, "tensors": {"p": TensorEntry("F32", (2,), "0" * 16, 0, 8, 64)}})
                       .to_json())
    assert plain["schema_version"] == 1 and "pieces" not in plain["tensors"]["p"]


def _hostile(d: dict, path: str, value) -> dict:
    *keys, last = path.split(".")
    node = d
    for k in keys:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is _DROP:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return d


_DROP = object()


@pytest.mark.parametrize("path, value, why", [
    ("kind", "anchor", "only a delta's entry"),
    ("tensors.rows.object", 0, "object null"),
    ("tensors.rows.xxh3", "0123456789abcdef", "not the digest of its pieces"),
    ("tensors.rows.pieces.cuts.0", [0, 4, 8], "cuts of dimension 0"),          # past the tensor's rows
    ("tensors.rows.pieces.cuts.0", [0, 4, 4, 7], "cuts of dimension 0"),       # not strictly ascending
    ("tensors.rows.pieces.cuts.0", [1, 4, 7], "cuts of dimension 0"),          # not from 0
    ("tensors.rows.pieces.cuts.0", [0, 7], "1 cell"),
    ("tensors.rows.pieces.cuts", [[0, 4, 7]], "pieces cuts (a list of 2 lists"),
    ("tensors.rows.pieces.cuts.1", list(range(7)), "xxh3 (a list of 12 values"),   # 12 cells, 2 digests
    ("tensors.rows.pieces.xxh3", ["00000000000000aa"], "xxh3 (a list of 2 values"),
    ("tensors.rows.pieces.xxh3.0", "XYZ", "xxh3 (16 lowercase hex"),
    ("tensors.rows.pieces.length.0", 5000, "piece 0: byte range beyond its object"),
    ("tensors.rows.pieces.object.0", 3, "piece 0: object index 3"),
    ("tensors.rows.pieces.offset.1", 8, "piece 1: an unchanged piece with a byte range"),
    ("tensors.rows.pieces.offset.0", -1, "piece 0: offset / length"),
    ("tensors.rows.pieces.extra", 1, "keys"),
    ("tensors.rows.pieces", [{"offsets": [0, 0]}], "an object with keys"),
    ("schema_version", 1, "schema_version 1 with pieced tensors"),
    ("schema_version", 3, "schema_version 3 is not supported"),
])
def test_hostile_pieced_entries_are_refused_naming_the_tensor(path, value, why):
    d = _hostile(_manifest_json(), path, value)
    if path == "kind":
        d["parent_version"] = None
        d["anchor_version"] = 1
    with pytest.raises(ManifestError) as e:
        Manifest.from_json(json.dumps(d).encode())
    assert why in str(e.value) and ("'rows'" in str(e.value) or "schema_version" in why)


def test_a_grid_of_more_cells_than_the_format_allows_is_refused_before_its_columns_are_read():
    d = _manifest_json()
    d["tensors"]["rows"]["shape"] = [300, 300]                     # 300 x 300 cells, each dimension in bounds
    d["tensors"]["rows"]["pieces"]["cuts"] = [list(range(301)), list(range(301))]
    with pytest.raises(ManifestError, match="more than 65536"):
        Manifest.from_json(json.dumps(d).encode())


def test_a_delta_without_pieces_at_schema_version_2_is_refused():
    d = _manifest_json()
    d["tensors"]["rows"] = {"dtype": "F32", "shape": [7, 6], "xxh3": "0" * 16, "object": 0, "offset": 8, "length": 64}
    with pytest.raises(ManifestError, match="schema_version 2 without pieced tensors"):
        Manifest.from_json(json.dumps(d).encode())


def test_every_reader_assembles_pieced_deltas_of_blocks_and_rows_bit_exact(pieced_run, tmp_path):
    url, store, truth = pieced_run
    reader = SnapshotReader(url)
    for v in (0, 1, 2):
        got = reader.read_tensors(v)
        assert all(_same(got[n], truth[v][n]) for n in truth[v]), v
    cached = SnapshotReader(url, cache_dir=str(tmp_path / "cache"))     # pieces' records through the disk cache
    for _ in range(2):
        assert all(_same(t, truth[2][n]) for n, t in cached.read_tensors(2).items())
    assert cached.stats["cache_hits"] >= 8
    m2 = reader.manifest(2)
    assert m2.tensors["grid"].pieces[2].object is None and m2.tensors["grid"].pieces[0].object is not None
    live = {n: t.clone() for n, t in truth[0].items()}
    swapper = HotSwapper(live, reader, version=0, stage_threads=1)
    for v in (1, 2, 0, 2, 1):                    # deltas forward, the anchor route back and forward again
        swapper.hotload(v)
        assert all(_same(live[n], truth[v][n]) for n in truth[v]), v
    assert reader.verify(2).tensors_checked == 9
    out = reader.materialize(2, str(tmp_path / "v2"))
    from safetensors.torch import load_file
    mat = load_file(os.path.join(out, "model.safetensors"))
    assert all(_same(mat[n], truth[2][n]) for n in truth[2])
    chain = read_chain(store, 2, reader.run_id)                      # the publisher's own reader, whole and by box
    assert all(_same(t, truth[2][n]) for n, t in rebuild(store, chain).items())
    boxes = rebuild_boxes(store, chain, {"grid": GRID_2X2[3], "rows": ROWS[1]})
    assert _same(boxes["grid"], truth[2]["grid"][3:, 4:].contiguous())
    assert _same(boxes["rows"], truth[2]["rows"][4:].contiguous())
    with pytest.raises(PublishError, match="other pieces"):          # a box the chain does not hold alone
        rebuild_boxes(store, chain, {"rows": ((0, 0), (7, 6))})


def test_live_rows_that_are_not_the_version_they_claim_are_refused_and_nothing_is_applied(pieced_run):
    url, _store, truth = pieced_run
    reader = SnapshotReader(url)
    live = {n: t.clone() for n, t in truth[1].items()}
    _bits(live["rows"]).reshape(7, 6)[5, 2] ^= 1               # rank 1's rows: one bit off
    before = {n: t.clone() for n, t in live.items()}
    with pytest.raises(ParentMismatchError):
        HotSwapper(live, reader, version=1, stage_threads=1).hotload(2)
    assert all(_same(live[n], before[n]) for n in live)


def test_inspect_lists_a_row_per_stored_box_of_a_pieced_tensor(pieced_run, capsys):
    from ckptdelta.cli import main

    url, _store, _truth = pieced_run
    assert main(["inspect", url, "2", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    assert sorted(rows) == ["grid [0:3, 0:4]", "grid [0:3, 4:9]", "grid [3:5, 4:9]", "plain", "rows [0:4, 0:6]",
                            "rows [4:7, 0:6]"]                          # grid [3:5, 0:4] kept its bits in v2
    assert rows["grid [0:3, 4:9]"]["shape"] == [3, 5] and rows["grid [0:3, 4:9]"]["has_parent"]


@pytest.mark.parametrize("name", ["grid", "rows"])     # blocks: staged from a copy; rows: box by box in place
def test_a_box_listed_unchanged_whose_bits_changed_is_caught_by_the_assembled_check(tmp_path, name):
    url = str(tmp_path / "run")
    w0 = _weights(0)
    with Publisher(url, progress=False, codec="fast") as pub:
        pub.publish(w0, 0)
    store = Store.from_url(url)
    w1 = _step(w0, 1)
    _pieced_delta(store, read_manifest(store, 0, None), w0, w1, 1, {"grid": GRID_2X2, "rows": ROWS},
                  claim_unchanged=((name, 1),))
    reader = SnapshotReader(url)
    with pytest.raises(ChecksumError, match="pieces hash to"):
        reader.read_tensors(1, [name])
    live = {n: t.clone() for n, t in w0.items()}
    with pytest.raises(ChecksumError):
        HotSwapper(live, reader, version=0, stage_threads=1).hotload(1)
    assert all(_same(live[n], w0[n]) for n in w0)                    # nothing applied
    with pytest.raises(ChecksumError):
        reader.verify(1)


def test_a_box_unchanged_must_carry_its_parents_digest_where_the_parent_has_the_same_boxes(pieced_run):
    url, store, truth = pieced_run
    reader = SnapshotReader(url)
    m1, m2 = reader.manifest(1), reader.manifest(2)
    from dataclasses import replace

    from ckptdelta.loader.reader import _check_link
    e = m2.tensors["grid"]
    bad = [replace(p, xxh3="0" * 16) if p.object is None else p for p in e.pieces]
    tampered = replace(m2, tensors={**m2.tensors, "grid": replace(e, pieces=tuple(bad), xxh3=pieces_digest(bad))})
    with pytest.raises(ManifestError, match="marked unchanged but its digest differs"):
        _check_link(tampered, m1)


def test_rank_0_refuses_pieces_that_disagree_or_do_not_tile_and_takes_a_whole_box_as_plain():
    sch = {"w": ("BF16", (4, 6))}
    ok, layout = plan_union([(sch, {"w": LocalBox((7, 6), (0, 0))}),
                             ({"w": ("BF16", (3, 6))}, {"w": LocalBox((7, 6), (4, 0))})], 1 << 20)
    assert ok == {"w": ("BF16", (7, 6))} and [p[0] for p in layout.pieces["w"].parts] == [0, 1]
    assert layout.shards == ((0, ("w",)),)
    whole, layout = plan_union([({"w": ("BF16", (7, 6))}, {"w": LocalBox((7, 6), (0, 0))}), ({}, {})], 1 << 20)
    assert whole == {"w": ("BF16", (7, 6))} and not layout.pieces
    with pytest.raises(PublishInputError, match="cannot be published: .*do not cover"):
        plan_union([({"w": ("BF16", (3, 6))}, {"w": LocalBox((7, 6), (0, 0))}),
                    ({"w": ("BF16", (3, 6))}, {"w": LocalBox((7, 6), (4, 0))})], 1 << 20)
    with pytest.raises(PublishInputError, match="disagree on DTensor 'w'"):
        plan_union([(sch, {"w": LocalBox((7, 6), (0, 0))}),
                    ({"w": ("F32", (3, 6))}, {"w": LocalBox((7, 6), (4, 0))})], 1 << 20)
    with pytest.raises(PublishInputError, match="DTensor on rank 0 but a plain tensor on rank 1"):
        plan_union([(sch, {"w": LocalBox((7, 6), (0, 0))}), ({"w": ("BF16", (3, 6))}, {})], 1 << 20)
    with pytest.raises(PublishInputError, match="published by both rank 0 and rank 1"):
        plan_union([({"p": ("F32", (2,))}, {}), ({"p": ("F32", (2,))}, {})], 1 << 20)
