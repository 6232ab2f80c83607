"""The chunk encodings' interface (delta/encodings/): one registered module per encoding, which every part
of the codec takes from the registry instead of switching on ids.

A test encoding ("fill": a chunk reset to one value, stored as that value) is registered here and
must be tried by the chunk coder, checked by the record parser, decoded by every decode path, warmed by
the warm-up and named by the records' statistics, with no other file knowing it; unregistered, its
records are refused as an unknown id. The built-in encodings must be exactly FORMAT.md's table.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptdelta.delta import chunks, codec, dtypes, record, warmup
from ckptdelta.delta.encodings import ALWAYS, REGISTRY, Candidate, Encoding, register
from ckptdelta.delta.errors import FormatError
from ckptdelta.publisher import codec_choice
from tests import REPO

FORMAT_MD = Path(REPO) / "docs" / "FORMAT.md"


class Fill(Encoding):
    """A chunk whose every element now holds one value: the payload is that value's bits."""

    id = 200
    name = "fill"
    tried = ALWAYS
    order = 5

    def __init__(self):
        self.warmed: list[str] = []

    def check_fields(self, planes_a, planes_b, count, n, itemsize, length, dtype_name):
        if not (1 <= count <= n and planes_a == 0 and planes_b == itemsize and length == itemsize):
            return f"fill chunk fields out of range (count={count}, planes={planes_a}/{planes_b}, length={length})"
        return None

    def encode(self, chunk):
        v = chunk.new[0]
        if not (chunk.new == v).all():
            return None
        return Candidate(self.id, 0, chunk.dt.itemsize, chunk.changed, v.tobytes())

    def decode(self, entry, payload, old, dt, where, out, grand):
        v = np.frombuffer(payload, dt.bits_dtype)[0]
        found = np.flatnonzero(old != v)
        if found.shape[0] != entry.count:
            raise FormatError(f"{where}: fill chunk changes {found.shape[0]} elements, its entry says {entry.count}")
        positions, values = (np.empty(entry.count, np.int64), np.empty(entry.count, dt.bits_dtype)) \
            if out is None else out
        positions[:] = found
        values[:] = v
        return positions, values

    def warm_up(self, old, new, grand, dt):
        self.warmed.append(dt.name)


@pytest.fixture
def fill():
    enc = register(Fill())
    yield enc
    REGISTRY.unregister(enc)


def _bf16(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


def test_a_new_encoding_is_one_registered_class_that_every_part_of_the_codec_takes_up(fill):
    old = _bf16(3000, 0)
    new = old.clone()
    new[1000:2000] = 0.5                                     # chunk 1: reset to one value, the fill encoding's
    new[:1000:50] = (new[:1000:50].float() * 1.01).to(torch.bfloat16)    # chunk 0: a few changes; chunk 2: none
    for context in (True, False):
        enc = codec.encode(old, new, chunk_elems=1000, context=context)
        counts = enc.encoding_counts()
        assert counts.pop("fill") == 1 and counts.pop("unchanged") == 1 and sum(counts.values()) == 1, counts
        assert enc.header.chunks[1].length == 2
        blob = enc.to_bytes()
        parsed = codec.EncodedTensor.from_bytes(blob)           # the parser takes its fields from the encoding
        assert parsed.header.chunks[1] == enc.header.chunks[1]
        assert np.array_equal(_bits(codec.decode(old, blob)), _bits(new))
        live = old.clone()
        codec.stage(live, blob).apply_(live)                    # decoded into the staged arrays, of its count
        assert np.array_equal(_bits(live), _bits(new))
        live = old.clone()
        codec.apply_(live, blob)
        assert np.array_equal(_bits(live), _bits(new))

    h = parsed.header
    bad = dataclasses.replace(h, chunks=(h.chunks[0], dataclasses.replace(h.chunks[1], planes_b=1), h.chunks[2]))
    forged = record.pack_header(bad) + b"".join(bytes(p) for p in parsed.payloads)
    with pytest.raises(FormatError, match=r"chunk 1: fill chunk fields out of range .*planes=0/1"):
        codec.EncodedTensor.from_bytes(forged)

    warmup._warm_encodings(old, new, seed=0)                    # the install warm-up runs its hook
    warmup._warm_stage(torch.float16, context=False)           # and a replica's, for what its codec tries
    assert fill.warmed == ["BF16", "F16", "F16"]

    REGISTRY.unregister(fill)
    try:
        with pytest.raises(FormatError, match="chunk 1: unknown encoding id 200"):
            codec.EncodedTensor.from_bytes(blob)
        assert codec.encode(old, new, chunk_elems=1000).encoding_counts().get("fill") is None
    finally:
        register(fill)


def test_an_id_or_name_is_registered_once(fill):
    for clash in ({"id": 200, "name": "other"}, {"id": 201, "name": "fill"}, {"id": 256, "name": "wide"}):
        with pytest.raises(ValueError):
            register(type("Clash", (Fill,), clash)())
    assert REGISTRY.by_id[200] is fill and 201 not in REGISTRY.by_id


def test_the_registered_encodings_are_exactly_format_md_s_table():
    text = FORMAT_MD.read_text()
    table = text[text.index("### Chunk encodings"):text.index("Sparse: changed chunk-local positions")]
    rows = re.findall(r"^\| (\d+) \| (\w+) \| ([^|]+) \|", table, re.M)
    assert len(rows) >= 7
    assert {int(i): name for i, name, _ in rows} == {e.id: e.name for e in REGISTRY}
    for i, name, parent in rows:
        e = REGISTRY.by_id[int(i)]
        assert e.needs_parent == parent.startswith("yes"), name
        assert e.needs_grandparent == ("grandparent" in parent), name
        assert e.count_is_changes == (name != "raw"), name       # raw's count is the chunk's elements
        assert e.__class__.__module__ == f"ckptdelta.delta.encodings.{name}"     # one module each, named as FORMAT.md does


def test_the_codec_choice_takes_each_codec_s_costs_from_the_encoding_that_stands_for_it():
    ctx, fast = chunks.codec_encoding(True), chunks.codec_encoding(False)
    assert (ctx.id, fast.id) == (chunks.CONTEXT_ENCODING, chunks.FAST_ENCODING) == (record.GCTX, record.SPARSE)
    assert codec_choice.WORK_PER_CHANGED == {"context": ctx.cost.work_per_changed, "fast": fast.cost.work_per_changed}
    assert codec_choice.DECODE_WORK == {"context": ctx.cost.decode_work, "fast": fast.cost.decode_work}
    assert codec_choice.PRIOR_FAST_VS_CONTEXT == {
        "encode": fast.cost.prior_per_work / ctx.cost.prior_per_work,
        "bytes": fast.cost.prior_bytes_per_changed / ctx.cost.prior_bytes_per_changed}


def test_each_codec_mode_tries_its_encodings_in_order_and_the_context_coder_it_names(monkeypatch):
    scanner, order = chunks.tries(True, grand=True)
    assert scanner.id == record.GCTX
    assert [e.name for e in order] == ["sparse", "gctx", "pctx", "dense_xor", "raw"]
    assert [e.name for e in chunks.tries(True)[1]] == ["sparse", "gctx", "dense_xor", "raw"]    # no grandparent
    # the fast path: its own dense steps (7 for an integer dtype, 8 for a float one, 9 with the grandparent)
    assert chunks.tries(False) == (None, tuple(REGISTRY.by_id[i] for i in (
        record.SPARSE, record.DENSE_STEP, record.GROUPED_STEP, record.DENSE_XOR, record.RAW)))
    assert chunks.tries(False, grand=True) == (None, tuple(REGISTRY.by_id[i] for i in (
        record.SPARSE, record.DENSE_STEP, record.GROUPED_STEP, record.GROUPED_PSTEP, record.DENSE_XOR, record.RAW)))
    monkeypatch.setattr(chunks, "CONTEXT_ENCODING", record.CTX)
    assert [e.name for e in chunks.tries(True, grand=True)[1]] == ["sparse", "ctx", "pctx", "dense_xor", "raw"]
    dt = dtypes.BY_NAME["BF16"]
    old = _bits(_bf16(20_000, 1)).view(np.uint16)
    new = old.copy()
    new[np.random.default_rng(2).random(new.shape[0]) < 0.05] += np.uint16(1)   # one ulp: the context coder's case
    assert chunks.encode_chunk(old, new, dt).entry.encoding == record.CTX
