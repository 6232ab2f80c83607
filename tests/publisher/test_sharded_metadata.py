"""Rank 0's metadata per publish of a sharded trainer: every rank's boxes planned (publisher/sharded.py), their
entries merged into pieced entries (publisher/writer.py), the manifest to JSON and parsed back (delta/manifest.py),
the chain advanced: as columns, with array operations, so that the Python it runs grows with the tensors and the
ranks, never with their product, the pieces (benchmarks/sharded.py measures the seconds; nothing here is timed).

The columns give the same answers as the format's rules checked one box at a time: the same grids accepted, the
same digests, the same manifest bytes, the same errors for hostile manifests.
"""

from __future__ import annotations

import gc
import json
import random
import sys
from collections import Counter

import numpy as np
import pytest

from benchmarks.sharded import synthetic_rank
from ckptdelta.delta.errors import ManifestError, PublishInputError
from ckptdelta.delta.manifest import Manifest, ObjectRef, PieceColumns, TensorEntry, pieces_digests
from ckptdelta.delta.pieces import PieceEntry, cells, grid_cuts, grid_problem, pieces_digest
from ckptdelta.publisher.chain import ChainState, decide
from ckptdelta.publisher.sharded import LocalBox, holdings, plan_union, with_boxes
from ckptdelta.publisher.writer import Written, merge


def _arrived(n_tensors: int, world: int, rows: int) -> tuple[list, list]:
    """What every rank sends rank 0 for one delta (its holdings, then its written share), as it arrives."""
    first = [holdings(*synthetic_rank(n_tensors, world, r, rows)[:2]) for r in range(world)]
    _union, layout = plan_union(first, 1 << 30)
    second = []
    for r in range(world):
        _sch, boxes, w = synthetic_rank(n_tensors, world, r, rows)
        second.append(with_boxes(w, boxes, layout).for_commit())
    return first, second


def _rank0(first: list, second: list) -> dict:
    """Rank 0's metadata of one delta, phase by phase; returns the Python lines each phase ran."""
    lines: Counter = Counter()
    phase = [""]

    def tracer(frame, event, arg):
        if event == "line":
            lines[phase[0]] += 1
        return tracer

    def run(name, fn):
        # the collector would run finalizers of earlier tests' objects (their lines counted) wherever it fires
        phase[0] = name
        gc.collect()
        gc.disable()
        sys.settrace(tracer)
        try:
            return fn()
        finally:
            sys.settrace(None)
            gc.enable()

    union, layout = run("plan", lambda: plan_union(first, 1 << 30))
    objects, entries, _wm, _x = run("merge", lambda: merge(second, layout))
    m = Manifest("r", 1, "delta", 0, 0, "now", 1, "w", tuple(objects), entries)
    data = run("to_json", m.to_json)
    back = run("from_json", lambda: Manifest.from_json(data))
    state = ChainState(0, 0, 0, 1 << 40, 0, dict(union), "delta", layout.grids())
    run("chain", lambda: decide(state.advanced(back), union, anchor_every=100, chain_fraction=1.0,
                                layout=layout.grids()))
    assert back == m
    return dict(lines)


def test_rank_0_runs_no_python_per_piece_only_per_tensor_and_per_rank():
    """Lines of Python per phase at T and 4T tensors on R and 4R ranks: with a cost of a per tensor, b per rank
    and c per piece, the mixed difference L(4T,4R) - L(4T,R) - L(T,4R) + L(T,R) is 9 c T R: zero for rank 0's
    columns (one object per piece, before them, ran ~150 lines a piece)."""
    t, r, rows = 6, 4, 64
    counts = {(a, b): _rank0(*_arrived(a, b, rows)) for a in (t, 4 * t) for b in (r, 4 * r)}
    per_piece = {k: (counts[4 * t, 4 * r][k] - counts[4 * t, r][k] - counts[t, 4 * r][k] + counts[t, r][k])
                 / (9 * t * r) for k in counts[t, r]}
    assert all(abs(x) < 0.05 for x in per_piece.values()), per_piece
    assert counts[4 * t, 4 * r]["from_json"] > 0 and counts[4 * t, 4 * r]["merge"] > 0    # the tracer saw them


def _random_layout(rng: random.Random) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A tensor and boxes of it: a grid's cells (random cuts in 1 to 3 dimensions), often spoiled: a box
    dropped, repeated, grown, shrunk or moved, or two boxes merged."""
    ndim = rng.randint(1, 3)
    shape = tuple(rng.randint(1, 9) for _ in range(ndim))
    cuts = [sorted({0, s, *rng.sample(range(1, s), rng.randint(0, s - 1))}) if s > 1 else [0, s] for s in shape]
    boxes = list(cells(cuts))
    how = rng.choice(["grid", "grid", "drop", "twice", "grow", "shrink", "move", "merge"])
    k = rng.randrange(len(boxes))
    o, s = boxes[k]
    d = rng.randrange(ndim)
    if how == "drop" and len(boxes) > 1:
        del boxes[k]
    elif how == "twice":
        boxes.append(boxes[k])
    elif how in ("grow", "shrink", "move"):
        o, s = list(o), list(s)
        if how == "grow":
            s[d] += 1
        elif how == "shrink":
            s[d] -= 1
        else:
            o[d] += rng.choice((-1, 1))
        boxes[k] = (tuple(o), tuple(s))
    elif how == "merge" and k + 1 < len(boxes):
        o2, s2 = boxes.pop(k + 1)
        boxes[k] = (o, tuple(max(a + x, b + y) - a for a, x, b, y in zip(o, s, o2, s2)))
    rng.shuffle(boxes)
    return shape, boxes


def test_rank_0_accepts_exactly_the_grids_the_format_rule_accepts_and_says_why_not():
    rng = random.Random(42)
    accepted, good = 0, []
    for case in range(400):
        shape, boxes = _random_layout(rng)
        gathered = [({"w": ("F32", s)}, {"w": LocalBox(shape, o)}) for o, s in boxes]
        problem = grid_problem(shape, sorted(boxes))
        whole = len(boxes) == 1 and boxes[0][1] == shape
        if problem is None or whole:
            union, layout = plan_union(gathered, 1 << 20)
            assert union == {"w": ("F32", shape)}, case
            if not whole:
                p = layout.pieces["w"]
                assert p.cuts == tuple(map(tuple, grid_cuts(shape, boxes))), case
                assert [(o, s) for _r, o, s in p.parts] == sorted(boxes), case
                accepted += 1
                good.append((shape, sorted(boxes)))
            continue
        with pytest.raises(PublishInputError, match="cannot be published") as e:
            plan_union(gathered, 1 << 20)
        assert problem in str(e.value), case
    assert accepted > 100
    # many tensors of different ndims planned together: each its own grid, its boxes' ranks in the format's order
    world = max(len(b) for _s, b in good)
    ranks = [({}, {}) for _ in range(world)]
    for i, (shape, boxes) in enumerate(good):
        for r, (o, s) in enumerate(reversed(boxes)):
            ranks[r][0][f"t{i}"] = ("BF16", s)
            ranks[r][1][f"t{i}"] = LocalBox(shape, o)
    union, layout = plan_union(ranks, 1 << 20)
    for i, (shape, boxes) in enumerate(good):
        p = layout.pieces[f"t{i}"]
        assert p.cuts == tuple(map(tuple, grid_cuts(shape, boxes)))
        assert [r for r, _o, _s in p.parts] == list(range(len(boxes)))[::-1]


def test_the_digests_of_many_grids_at_once_are_each_ones_digest_of_its_pieces():
    rng = random.Random(7)
    grids, pieces = [], []
    for _ in range(60):
        shape, _boxes = _random_layout(rng)
        cuts = grid_cuts(shape, list(cells([[0, s] for s in shape])))
        cuts = [sorted({0, s, *rng.sample(range(1, s), rng.randint(0, s - 1))}) if s > 1 else c
                for s, c in zip(shape, cuts)]
        grids.append(cuts)
        pieces.append([PieceEntry(o, s, f"{rng.getrandbits(64):016x}", None) for o, s in cells(cuts)])
    xxh3 = np.array([int(p.xxh3, 16) for ps in pieces for p in ps], np.uint64)
    assert pieces_digests(grids, xxh3) == [pieces_digest(ps) for ps in pieces]


def _delta(names: list[str], world: int = 4) -> Manifest:
    """A delta of tensors in pieces on 4 ranks (row ranges, and the blocks of a 2 x 2 grid), merged from its
    ranks' records as rank 0 merges them, some pieces unchanged, and a plain tensor."""
    ranks = [({}, {}) for _ in range(world)]
    for i, n in enumerate(names):
        for r in range(world):
            if i % 2:
                ranks[r][0][n], ranks[r][1][n] = ("BF16", (2, 5)), LocalBox((2 * world, 5), (2 * r, 0))
            else:
                ranks[r][0][n], ranks[r][1][n] = ("F32", (1, 4)), LocalBox((2, 8), (r // 2, 4 * (r % 2)))
    _union, layout = plan_union(ranks, 1 << 20)
    parts = []
    for r, (sch, boxes) in enumerate(ranks):
        w = Written(objects=[ObjectRef(f"deltas/000000000001-w/rank-{r:05d}.ckd", 1 << 20, f"{r:016x}")])
        for i, n in enumerate(names):
            changed = (i + r) % 3 != 0
            w.entries[n] = TensorEntry(sch[n][0], sch[n][1], f"{(i * 131 + r) * 0x9E3779B1 % (1 << 64):016x}",
                                       0 if changed else None, 64 * i if changed else 0, 40 if changed else 0)
        parts.append(with_boxes(w, boxes, layout).for_commit())
    parts[0].entries["plain"] = TensorEntry("F16", (3,), "00000000000000ff", 0, 4000, 30)
    objects, entries, _wm, _x = merge(parts, layout)
    return Manifest("r", 1, "delta", 0, 0, "2025-01-01T00:00:00.000Z", 1, "w", tuple(objects), entries,
                    metadata={"note": "caf\u00e9 \"quoted\""})


def test_a_merged_delta_is_written_byte_for_byte_as_its_pieces_one_by_one_and_parses_back_equal():
    names = ["model.layers.0.w", "caf\u00e9.\u03c0", 'q"uote\\d', "\u2603\U0001f600", "model.norm"]
    m = _delta(names)
    assert all(isinstance(m.tensors[n].pieces, PieceColumns) for n in names)
    one_by_one = Manifest(**{**m.__dict__, "tensors": {
        n: TensorEntry(e.dtype, e.shape, e.xxh3, e.object, e.offset, e.length, tuple(e.pieces))
        for n, e in m.tensors.items()}})
    data = m.to_json()
    assert data == one_by_one.to_json()          # the entries' pieces written as a list of objects would be
    assert json.loads(data) == json.loads(json.dumps(json.loads(data)))
    back = Manifest.from_json(data)
    assert back == m == one_by_one and back.to_json() == data
    e = back.tensors[names[1]]
    assert e.pieces == tuple(e.pieces) and e.pieces[1] == m.tensors[names[1]].pieces[1]
    assert e.xxh3 == pieces_digest(tuple(e.pieces)) and e.grid == tuple(map(tuple, grid_cuts(e.shape, [
        p.box for p in e.pieces])))
    assert e.has_data and not TensorEntry("F32", (3, 4), e.xxh3, None, 0, 0, PieceColumns(
        ((0, 1, 3), (0, 4)), "0" * 32, [None, None], [0, 0], [0, 0])).has_data


_HOSTILE = [-1, 1 << 62, 1 << 63, 1 << 70, True, None, 1.5, "7", 0, 10 ** 9, [1]]


def test_hostile_piece_columns_are_refused_as_the_checks_one_piece_at_a_time_refuse_them():
    """Every column value corrupted, one at a time, in a delta of several pieced tensors: the manifest is
    refused exactly when the checks one piece at a time refuse it, with their message, naming the first tensor
    and piece that fails."""
    import ckptdelta.delta.manifest as dm

    names = [f"t{i}" for i in range(4)]
    good = json.loads(_delta(names).to_json())
    rng = random.Random(3)
    refused = 0
    for case in range(300):
        d = json.loads(json.dumps(good))
        n = rng.choice(names)
        col = rng.choice(["object", "offset", "length", "xxh3"])
        k = rng.randrange(len(d["tensors"][n]["pieces"][col]))
        d["tensors"][n]["pieces"][col][k] = rng.choice(_HOSTILE) if col != "xxh3" else \
            rng.choice(["0123456789ABCDEF", "0" * 15 + "g", d["tensors"][n]["pieces"][col][k][::-1]])
        data = json.dumps(d).encode()
        ref = None
        try:                         # the checks one by one, entry by entry, as the format states them
            objects = tuple(ObjectRef(o["key"], o["size"], o["xxh3"]) for o in d["objects"])
            for name, t in d["tensors"].items():
                if "pieces" not in t:
                    continue
                p = t["pieces"]
                if not (set(map(type, p["xxh3"])) == {str} and set(map(len, p["xxh3"])) == {16}):
                    raise ManifestError(f"tensor {name!r}: invalid pieces xxh3 (16 lowercase hex digits each)")
                cols = PieceColumns(p["cuts"], p["xxh3"], p["object"], p["offset"], p["length"])
                dm._check_one_by_one(dm._Pieced(f"tensor {name!r}", t["xxh3"], t["dtype"], len(name.encode()),
                                                cols), objects)
        except ManifestError as e:
            ref = str(e)
        if ref is None:
            assert Manifest.from_json(data).tensors[n].pieces is not None, case
            continue
        refused += 1
        with pytest.raises(ManifestError) as e:
            Manifest.from_json(data)
        assert ref.split("tensor ", 1)[1] in str(e.value), (case, ref, str(e.value))
    assert refused > 200


def test_an_earlier_entrys_bad_piece_is_the_error_reported_before_a_later_entrys_bad_structure():
    d = json.loads(_delta(["a", "b"]).to_json())
    d["tensors"]["a"]["pieces"]["offset"][0] = -5
    d["tensors"]["b"]["pieces"]["cuts"][0] = [0, 9]
    with pytest.raises(ManifestError, match=r"tensor 'a'.*piece 0: offset / length"):
        Manifest.from_json(json.dumps(d).encode())


def test_rank_0_refuses_pieces_a_rank_sent_that_are_not_the_plans_and_a_pieced_tensor_without_entry():
    from ckptdelta.delta.errors import PublishError

    first, second = _arrived(3, 4, 8)
    _union, layout = plan_union(first, 1 << 30)
    assert len(merge(second, layout)[1]) == 3
    short = Written(objects=second[2].objects, pieces=type(second[2].pieces)(
        *(a[:-1] for a in (second[2].pieces.tensor, second[2].pieces.xxh3, second[2].pieces.object,
                           second[2].pieces.offset, second[2].pieces.length))))
    with pytest.raises(PublishError, match="rank 2 sent entries of 2 pieces where the plan gives it 3"):
        merge([*second[:2], short, second[3]], layout)
    anchor = [Written(objects=w.objects) for w in second]       # no rank wrote the tensors in pieces whole
    with pytest.raises(PublishError, match="'model.layers.0.mlp.proj_0.weight' .held in pieces. has no entry"):
        merge(anchor, layout)
    _sch, boxes, w = synthetic_rank(3, 4, 0, 8)
    with pytest.raises(ValueError, match="plan's layout"):
        merge([with_boxes(w, boxes, layout)])
