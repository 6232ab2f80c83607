"""Snapshots of edge-shaped but valid tensors: every check accepts them and every reader returns the published bits.

Zero-element tensors (at the start, in the middle and at the end of a shard, and alone in a shard, which then
holds no data at all), scalars (0-d) of every width, and one-byte tensors (uint8, bool) as the last byte of a
shard, the first of the next, and alone in one: the real Publisher writes an anchor and two deltas of each
(tensors laid out as safetensors lays them: by decreasing element size, so an empty tensor's range starts where
the next tensor's does, or at the shard's very end). Each case first checks that its layout really has the edge
it is named after, then that the manifest parser, the reader (one batch, and a batch per tensor),
``materialize``, ``verify`` (the API, with reads of 1 and 7 bytes so that read boundaries fall everywhere, and
the CLI) and a hot-load (forward, back to the anchor) all accept every version and give its bits exactly.
Real damage is still refused: overlapping ranges, and a range past the end of its shard.

Regression (issue 39, defect 7): ``verify`` called such a snapshot damaged ("ranges overlap or pass the end"
for an empty tensor whose range starts where the next tensor's does; "ended before tensor" for one at the end of
a shard) while reading, hot-loading and materializing gave the published bits.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from ckptdelta.delta.errors import ChecksumError, ManifestError
from ckptdelta.delta.manifest import Manifest, manifest_key
from ckptdelta.delta.storage import Store
from ckptdelta.loader import verify
from ckptdelta.cli import read as cli_read
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from tests.bucketgen import bits_equal

Weights = dict[str, torch.Tensor]


def _empty_in_one_shard() -> Weights:
    g = torch.Generator().manual_seed(1)
    return {"a.first": torch.empty(0, 3, dtype=torch.float64),      # the widest: laid out first
            "b.w": torch.randn(6, 4, generator=g),
            "z.mid": torch.empty(0, 4),                             # starts where m.w starts; sorts after it
            "m.w": torch.randn(5, generator=g),
            "h.half": torch.randn(3, generator=g).to(torch.bfloat16),
            "y.mid16": torch.empty(4, 0, dtype=torch.bfloat16),
            "u.byte": torch.tensor([3, 4], dtype=torch.uint8),
            "z.end": torch.empty(0, dtype=torch.bool)}              # laid out last: at the shard's very end


def _empty_shards() -> Weights:
    g = torch.Generator().manual_seed(2)
    return {"e.0": torch.empty(0, 4),                              # alone in the first shard: no data bytes
            "w": torch.randn(64, generator=g),                     # 256 bytes: a shard of its own
            "e.1": torch.empty(2, 0, dtype=torch.bfloat16),         # the last shard: two empty tensors
            "e.2": torch.empty(0, dtype=torch.uint8)}


def _scalars() -> Weights:
    g = torch.Generator().manual_seed(3)
    return {"s.f64": torch.tensor(float("nan"), dtype=torch.float64), "s.f32": torch.tensor(3.5),
            "s.bf16": torch.tensor(-0.0, dtype=torch.bfloat16), "s.i64": torch.tensor(-(2 ** 62)),
            "s.u8": torch.tensor(7, dtype=torch.uint8), "s.bool": torch.tensor(True),
            "w": torch.randn(5, 3, generator=g)}


def _one_byte_at_boundaries() -> Weights:
    g = torch.Generator().manual_seed(4)
    return {"w.0": torch.randn(15, generator=g),                   # 60 bytes ...
            "b.0": torch.tensor([7], dtype=torch.uint8),           # ... and the 61st: the shard's last byte
            "b.1": torch.tensor([True]),                           # the next shard's first data byte
            "u.1": torch.arange(60, dtype=torch.uint8),
            "b.2": torch.tensor([5], dtype=torch.uint8),           # alone in a shard: one data byte
            "w.3": torch.randn(30, generator=g),                   # 120 bytes: a shard of its own
            "b.4": torch.tensor(False)}                            # a one-byte scalar, alone in the last shard


def _step(w: Weights, k: int) -> Weights:
    """The next version: every tensor with elements changes (one-byte ones and scalars included)."""
    out = {}
    for name, t in w.items():
        if t.numel() == 0:
            out[name] = t.clone()
        elif t.dtype == torch.bool:
            out[name] = ~t
        elif t.is_floating_point():
            out[name] = t + (k + 1) * 0.25
        else:
            out[name] = t + (k + 1)          # wraps for uint8, as a step may
    return out


def _layout(m: Manifest) -> dict[str, tuple[int, int, int, int]]:
    """name -> (shard index, offset, length, shard size) of an anchor."""
    return {n: (e.object, e.offset, e.length, m.objects[e.object].size) for n, e in m.tensors.items()}


def _has_empty_at_start_middle_and_end(m: Manifest) -> None:
    lay = _layout(m)
    assert {lay[n][0] for n in lay} == {0}                                   # one shard
    assert lay["a.first"][1] == min(off for _s, off, _n, _z in lay.values())  # where the data starts
    assert lay["z.mid"][1] == lay["m.w"][1] and lay["m.w"][2] > 0             # an empty range inside the data
    assert lay["z.end"][1] == lay["z.end"][3]                                 # at the shard's end


def _has_shards_without_data(m: Manifest) -> None:
    lay = _layout(m)
    shards = {lay[n][0]: sorted(k for k in lay if lay[k][0] == lay[n][0]) for n in ("e.0", "e.1")}
    assert list(shards.values()) == [["e.0"], ["e.1", "e.2"]] and len(m.objects) == 3 + 1    # and the index
    assert all(lay[n][2] == 0 and lay[n][1] == lay[n][3] for n in ("e.0", "e.1", "e.2"))     # no data bytes


def _has_scalars(m: Manifest) -> None:
    assert sum(e.shape == () for e in m.tensors.values()) == 6


def _has_one_byte_tensors_at_boundaries(m: Manifest) -> None:
    lay = _layout(m)
    assert lay["b.0"][1] + 1 == lay["b.0"][3] and lay["b.0"][0] == lay["w.0"][0]     # last byte of its shard
    first_data = {s: min(off for s2, off, _n, _z in lay.values() if s2 == s) for s in {v[0] for v in lay.values()}}
    assert lay["b.1"][1] == first_data[lay["b.1"][0]] and lay["b.1"][0] == lay["b.0"][0] + 1   # the next's first
    for n in ("b.2", "b.4"):
        assert lay[n][1] + 1 == lay[n][3] == first_data[lay[n][0]] + 1                  # alone: its only byte


CASES: dict[str, tuple[Callable[[], Weights], int, Callable[[Manifest], None]]] = {
    "empty tensors at the start, middle and end of a shard": (_empty_in_one_shard, 1 << 30,
                                                              _has_empty_at_start_middle_and_end),
    "shards that hold only empty tensors": (_empty_shards, 100, _has_shards_without_data),
    "scalars of every width": (_scalars, 1 << 30, _has_scalars),
    "one-byte tensors at shard boundaries": (_one_byte_at_boundaries, 61, _has_one_byte_tensors_at_boundaries),
}


def _publish(url: str, opts: dict, case: str) -> list[Weights]:
    make, shard_bytes, _ = CASES[case]
    versions = [make()]
    versions += [_step(versions[-1], 0)]
    versions += [_step(versions[-1], 1)]
    with Publisher(url, storage_options=opts, shard_bytes=shard_bytes, anchor_chain_fraction=1000.0,
                   progress=False) as pub:
        for step, w in enumerate(versions):
            pub.publish(w, step)
    return versions


def _same(got: Weights, want: Weights) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert bits_equal(got[k], want[k]), k


def _check_every_reader(url: str, opts: dict, truth: list[Weights], tmp_path, monkeypatch,
                        read_sizes: tuple[int, ...] = (verify.READ_BYTES, 7, 1)) -> None:
    reader = SnapshotReader(url, storage_options=opts)
    store = Store.from_url(url, opts)
    assert [m.kind for m in reader.chain(2)] == ["anchor", "delta", "delta"]
    for v, want in enumerate(truth):
        m = reader.manifest(v)
        parsed = Manifest.from_json(store.get(manifest_key(v)), run_id=reader.run_id)        # the parser
        assert parsed == m and Manifest.from_json(m.to_json()) == m
        _same(reader.read_tensors(v), want)                                                   # the reader
        _same(dict(reader.iter_tensors(v, batch_bytes=1)), want)
        out = reader.materialize(v, str(tmp_path / f"m{v}"))                                  # materialize
        files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        _same({k: t for f in files for k, t in load_file(os.path.join(out, f)).items()}, want)
        for read_bytes in read_sizes:                                                         # verify
            monkeypatch.setattr(verify, "READ_BYTES", read_bytes)
            rep = SnapshotReader(url, storage_options=opts).verify(v)
            assert rep.chain == list(range(v + 1)) and rep.tensors_checked == len(want) * (v + 1)
        monkeypatch.setattr(verify, "READ_BYTES", verify.READ_BYTES)
    live = {k: t.clone() for k, t in truth[0].items()}                                       # a hot-load
    swapper = HotSwapper(live, SnapshotReader(url, storage_options=opts), version=0)
    for v in (1, 2, 0, 2):
        swapper.hotload(v)
        _same(live, truth[v])


@pytest.mark.parametrize("case", list(CASES))
def test_every_check_accepts_edge_shaped_tensors_and_every_reader_gives_their_bits(case, tmp_path, monkeypatch,
                                                                                   capsys):
    url = str(tmp_path / "run")
    truth = _publish(url, {}, case)
    CASES[case][2](SnapshotReader(url).manifest(0))          # the layout has the edge the case is named after
    _check_every_reader(url, {}, truth, tmp_path, monkeypatch)
    for v in range(3):
        assert cli_read.main(["verify", url, str(v)]) == 0
        assert f"ok: v{v:08d}" in capsys.readouterr().out


@pytest.mark.parametrize("store_url", ["s3"], indirect=True)
def test_edge_shaped_tensors_at_shard_boundaries_read_back_and_verify_on_s3(store_url, tmp_path, monkeypatch):
    url, opts = store_url
    truth = _publish(url, opts, "one-byte tensors at shard boundaries")
    CASES["one-byte tensors at shard boundaries"][2](SnapshotReader(url, storage_options=opts).manifest(0))
    # whole reads only: a request a byte would be thousands of requests to moto (the local case reads this
    # layout 1 and 7 bytes at a time)
    _check_every_reader(url, opts, truth, tmp_path, monkeypatch, read_sizes=(verify.READ_BYTES,))


def _rewrite_anchor(url: str, edit: Callable[[dict], None]) -> None:
    """Change the anchor's manifest entries (and nothing that would stop the parser): a damaged manifest."""
    store = Store.from_url(url)
    doc = json.loads(store.get(manifest_key(0)))
    edit(doc["tensors"])
    store.put(manifest_key(0), json.dumps(doc).encode())


def test_verify_still_refuses_overlapping_ranges_and_a_range_past_the_end_of_its_shard(tmp_path):
    """The checks that accept empty ranges where safetensors puts them still refuse what no writer produces: a
    tensor whose range overlaps another's, an empty range inside another tensor's, and one past the end."""
    cases: dict[str, Callable[[dict], None]] = {
        "overlap": lambda t: t["m.w"].update(offset=t["m.w"]["offset"] - 4),
        "empty inside another": lambda t: t["z.mid"].update(offset=t["b.w"]["offset"] + 4),
    }
    for what, edit in cases.items():
        url = str(tmp_path / what.replace(" ", "-"))
        _publish(url, {}, "empty tensors at the start, middle and end of a shard")
        _rewrite_anchor(url, edit)
        with pytest.raises(ChecksumError, match="overlap") as info:
            SnapshotReader(url).verify(1)          # not the head: the head pointer's digest would be checked first
        assert "snapshot v00000000" in str(info.value)
    url = str(tmp_path / "past-the-end")
    _publish(url, {}, "empty tensors at the start, middle and end of a shard")
    _rewrite_anchor(url, lambda t: t["z.end"].update(offset=t["z.end"]["offset"] + 1))
    with pytest.raises(ManifestError, match="byte range beyond its object"):
        SnapshotReader(url).verify(1)
