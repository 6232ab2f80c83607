"""Corrupt, truncated and hostile bytes are rejected with a DeltaError, never decoded wrong.

Every single flipped byte and every truncation of a small multi-chunk record,
every file in tests/attacks/, and forged headers with valid checksums (so the
field checks, not the digests, must catch them) — each must raise a subclass of
the project's errors that names the tensor (and chunk), without crashing,
hanging, returning a wrong tensor, or allocating what the header claims.
"""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from ckptdelta.delta import codec, container, dtypes, errors, record
from ckptdelta.delta.manifest import Manifest
from tests.attacks import make_attacks
from tests import TESTS

ATTACKS = Path(TESTS) / "attacks"
NAME = "model.layers.7.attn.qkv"
MAX_PEAK = 32 << 20  # bytes Python may allocate while rejecting a hostile input


def _multi_chunk_pair() -> tuple[np.ndarray, np.ndarray]:
    """F32[64] in chunks of 16: unchanged, sparse, dense XOR and raw (a reset), in that order."""
    rng = np.random.default_rng(3)
    old = (rng.standard_normal(64) * 0.02).astype(np.float32)
    new = old.copy()
    new[20] = np.float32(1.5)
    new.view(np.uint32)[32:48] ^= 1
    new[48:] = 0
    return old, new


@pytest.fixture(scope="module")
def delta_record():
    old, new = _multi_chunk_pair()
    enc = codec.encode(old, new, name=NAME, chunk_elems=16)
    assert [c.encoding for c in enc.header.chunks] == [record.UNCHANGED, record.SPARSE, record.DENSE_XOR, record.RAW]
    return old, new, enc.to_bytes(), enc.header


@pytest.fixture(scope="module")
def raw_record():
    _old, new = _multi_chunk_pair()
    enc = codec.encode(None, new, name=NAME, chunk_elems=16)
    return new, enc.to_bytes(), enc.header


def _chunk_of(offset: int, h: record.RecordHeader) -> int | None:
    for i, (start, c) in enumerate(zip(h.payload_offsets(), h.chunks)):
        if start <= offset < start + c.length:
            return i
    return None


def _name_intact(offset: int, h: record.RecordHeader) -> bool:
    """Whether a flip at ``offset`` leaves the header's name (and the fields that locate it) readable."""
    name_start = record.FIXED_SIZE + 8 * len(h.shape)
    return offset not in (7, 44, 45) and not name_start <= offset < name_start + len(h.name.encode())


def _decode_must_fail(old, data: bytes, what: str) -> errors.DeltaError:
    try:
        out = codec.decode(old, data)
    except errors.DeltaError as e:
        return e
    raise AssertionError(f"{what}: decoded without error to {out!r}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("xor", [0xFF, 0x01])
def test_every_flipped_byte_of_a_delta_record_is_rejected(delta_record, xor):
    old, _new, buf, h = delta_record
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= xor
        e = _decode_must_fail(old, bytes(bad), f"flip {xor:#x} at byte {i}")
        msg = str(e)
        if _name_intact(i, h):
            assert NAME in msg, f"byte {i}: {msg}"
        chunk = _chunk_of(i, h)
        if chunk is not None:
            assert f"chunk {chunk}" in msg, f"byte {i}: {msg}"
        live = old.copy()
        with pytest.raises(errors.DeltaError):
            codec.apply_(live, bytes(bad))
        np.testing.assert_array_equal(live.view(np.uint32), old.view(np.uint32), err_msg=f"byte {i} changed live")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("xor", [0xFF, 0x01])
def test_every_flipped_byte_of_a_parentless_record_is_rejected(raw_record, xor):
    _new, buf, h = raw_record
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= xor
        e = _decode_must_fail(None, bytes(bad), f"flip {xor:#x} at byte {i}")
        if _name_intact(i, h):
            assert NAME in str(e), f"byte {i}: {e}"


@pytest.mark.timeout(120)
def test_every_truncation_is_rejected_and_named(delta_record, raw_record):
    old, _new, buf, h = delta_record
    name_end = record.FIXED_SIZE + 8 * len(h.shape) + len(NAME.encode())
    for parent, data in ((old, buf), (None, raw_record[1])):
        for k in range(len(data)):
            e = _decode_must_fail(parent, data[:k], f"truncated to {k} bytes")
            assert isinstance(e, (errors.TruncatedError, errors.FormatError)), f"{k}: {e!r}"
            if k >= name_end:
                assert NAME in str(e), f"{k}: {e}"
        for extra in (b"\0", b"\0" * 100):
            with pytest.raises(errors.FormatError, match="record is"):
                codec.decode(parent, data + extra)


def _reseal(buf: bytearray, h: record.RecordHeader) -> bytes:
    """Recompute every payload checksum and the header checksum, as a careless or hostile writer would."""
    table = record.FIXED_SIZE + 8 * len(h.shape) + (-len(h.name.encode()) % 8) + len(h.name.encode())
    size = record.peek_header_size(bytes(buf))
    if size > len(buf):
        return bytes(buf)
    off = size
    for i in range(struct.unpack_from("<I", buf, 40)[0]):
        e = table + i * record.CHUNK_ENTRY_SIZE
        if e + record.CHUNK_ENTRY_SIZE > size - 8:
            break
        (length,) = struct.unpack_from("<Q", buf, e + 8)
        if off + length <= len(buf):
            struct.pack_into("<Q", buf, e + 16, xxhash.xxh3_64_intdigest(bytes(buf[off:off + length])))
        off += length
    struct.pack_into("<Q", buf, size - 8, xxhash.xxh3_64_intdigest(bytes(buf[:size - 8])))
    return bytes(buf)


@pytest.mark.timeout(180)
def test_resealed_corruption_is_rejected_or_decodes_exactly(delta_record, raw_record):
    """With checksums recomputed, the field checks, frame checks and final digest still stand:
    every flip either raises a DeltaError or leaves the decoded bits exactly right."""
    old, new, buf, h = delta_record
    _, raw_buf, raw_h = raw_record
    name_start = record.FIXED_SIZE + 8
    name_bytes = range(name_start, name_start + len(NAME.encode()))
    undone = 0
    for parent, data, hdr, want in ((old, buf, h, new), (None, raw_buf, raw_h, new)):
        decoded_ok, n_undone = _resealed_flips(parent, data, hdr, want, old)
        undone += n_undone
        # only a renamed tensor may come out (the manifest, not the record, says which tensor it is), or one
        # whose record names another parent digest: the result's digest proves the bits, the parent's is
        # compared only to name a failure (codec.diagnose_parent) and by the loader's plan
        parent_field = range(32, 40) if parent is not None else range(0)
        assert set(decoded_ok) <= set(name_bytes) | set(parent_field), \
            sorted(set(decoded_ok) - set(name_bytes) - set(parent_field))
    assert undone > 0  # some corruptions only show in the final digest: the undo path ran


def _dense_pair(seed: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """96 elements (float32 or int32; float16: 192) in three chunks: every element changed, half changed, one
    changed. Compared as 32-bit words."""
    rng = np.random.default_rng(seed)
    n = 48 * (4 // np.dtype(dtype).itemsize)
    old = (rng.standard_normal(n) * 0.02).astype(np.float32 if dtype == np.int32 else dtype).view(dtype)
    bits = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    new = old.copy()
    third = n // 3
    new.view(bits)[:third] += rng.integers(1, 300, third).astype(bits)           # every element: dense steps
    new.view(bits)[third:2 * third:2] -= bits(1)                                  # half: dense steps
    new.view(bits)[2 * third + 8] ^= bits(1 << (8 * np.dtype(dtype).itemsize - 1))    # one: sparse
    return old, new


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,dense", [(np.float32, record.DENSE_STEP), (np.int32, record.DENSE_STEP),
                                         (np.float16, record.GROUPED_STEP)],
                         ids=["dense_step-f32", "dense_step-i32", "grouped_step-f16"])
def test_every_resealed_flip_of_a_dense_step_record_is_rejected_or_decodes_exactly(dtype, dense):
    """The fast path's dense steps (encoding 7 for a 32-bit dtype, 8 for a 16-bit float: one chunk all changed, one
    half changed, plus a sparse chunk): with checksums recomputed, every flip of the header's fields or of a
    payload raises a DeltaError (a step count that disagrees with the entry's, a frame of the wrong size, the
    result's digest) or decodes to the record's exact bits, and an in-place apply that fails leaves the live
    tensor as it was."""
    old, new = _dense_pair(5, dtype)
    enc = codec.encode(old, new, name=NAME, chunk_elems=old.shape[0] // 3, context=False)
    h = enc.header
    assert [c.encoding for c in h.chunks] == [dense, dense, record.SPARSE]
    data = enc.to_bytes()
    table = record.FIXED_SIZE + 8 + len(NAME.encode()) + (-len(NAME.encode()) % 8)
    decoded_ok, _ = _resealed_flips(old, data, h, new, old, start=table)     # the chunk table and the payloads
    assert decoded_ok == []


@pytest.mark.timeout(120)
def test_every_resealed_flip_of_a_grouped_pstep_record_is_rejected_or_decodes_exactly_with_its_grandparent():
    """Encoding 9 (dense steps grouped by class and by the step before, a LoRA delta's): every resealed flip of
    its chunk table and payloads, decoded with the grandparent (densely and into the sparse form), raises a
    DeltaError or decodes to the record's exact bits; without the grandparent the intact record is refused
    by name."""
    old, new = _dense_pair(7, np.float16)
    grand = old.copy()
    grand.view(np.uint16)[::3] += np.uint16(2)                                    # the step before: some up
    grand.view(np.uint16)[1::3] -= np.uint16(3)                                   # some down, some none
    enc = codec.encode(old, new, name=NAME, chunk_elems=old.shape[0] // 3, context=False, grandparent=grand)
    h = enc.header
    assert [c.encoding for c in h.chunks] == [record.GROUPED_PSTEP, record.GROUPED_PSTEP, record.SPARSE]
    np.testing.assert_array_equal(np.asarray(codec.decode(old, enc, grandparent=grand)).view(np.uint32),
                                  new.view(np.uint32))
    with pytest.raises(errors.GrandparentNeededError, match="grouped_pstep"):
        codec.decode(old, enc)
    data = enc.to_bytes()
    table = record.FIXED_SIZE + 8 + len(NAME.encode()) + (-len(NAME.encode()) % 8)
    ok = []
    for i, xor, sealed in _flips(data, h, start=table):
        for stage in (False, True):
            try:
                if stage:
                    st = codec.stage(old, sealed, grandparent=grand)
                    got = st.dense if st.dense is not None else None
                    if got is None:
                        out = old.copy()
                        st.apply_(out)
                        got = out
                else:
                    got = codec.decode(old, sealed, grandparent=grand)
            except errors.DeltaError:
                continue
            np.testing.assert_array_equal(np.asarray(got).reshape(-1).view(np.uint32), new.view(np.uint32),
                                          err_msg=f"byte {i} xor {xor:#x}")
            ok.append(i)
    assert ok == []


def test_every_resealed_flip_of_a_densely_staged_dense_step_record_is_rejected_or_stages_exactly():
    """A replica's hot-load stages a mostly changed record densely, dense_step chunks decoding every element
    straight into the staged copy (the others' changes scattered over it): every resealed flip of its chunk
    table and payloads raises a DeltaError or stages the record's exact bits, and the live tensor is never
    written."""
    rng = np.random.default_rng(6)
    old = (rng.standard_normal(48) * 0.02).astype(np.float32)
    new = old.copy()
    new.view(np.uint32)[:16] += rng.integers(1, 300, 16).astype(np.uint32)
    new.view(np.uint32)[16:32:2] -= 1
    new[40] = np.float32(-0.0)
    enc = codec.encode(old, new, name=NAME, chunk_elems=16, context=False)
    h = enc.header
    # dense steps decode densely themselves; dense XOR and sparse changes are scattered over the parent's bits
    assert [c.encoding for c in h.chunks] == [record.DENSE_STEP, record.DENSE_XOR, record.SPARSE]
    st = codec.stage(old, enc)
    assert st.dense is not None and st.positions.shape[0] == 0
    np.testing.assert_array_equal(st.dense, new.view(np.uint32))
    data = enc.to_bytes()
    table = record.FIXED_SIZE + 8 + len(NAME.encode()) + (-len(NAME.encode()) % 8)
    live, staged_ok = old.copy(), []
    for i, xor, sealed in _flips(data, h, start=table):
        try:
            got = codec.stage(live, sealed)
        except errors.DeltaError:
            continue
        finally:
            np.testing.assert_array_equal(live.view(np.uint32), old.view(np.uint32))
        bits = got.dense
        if bits is None:
            out = live.copy()
            got.apply_(out)
            bits = out.view(np.uint32)
        np.testing.assert_array_equal(bits, new.view(np.uint32), err_msg=f"byte {i} xor {xor:#x}")
        staged_ok.append(i)
    assert staged_ok == []


def _flips(data: bytes, hdr: record.RecordHeader, start: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(offset, xor, resealed record) for each byte of ``data`` from ``start`` flipped by 0x01, 0x80 and 0xFF
    (not the checksums, which resealing recomputes), where the fixed header still parses."""
    table = record.FIXED_SIZE + 8 * len(hdr.shape) + len(hdr.name.encode()) + (-len(hdr.name.encode()) % 8)
    checksums = {table + 24 * c + 16 + k for c in range(len(hdr.chunks)) for k in range(8)}
    checksums |= set(range(hdr.header_size - 8, hdr.header_size))
    for i in range(start, len(data)):
        if i in checksums:
            continue  # resealing recomputes these, undoing the flip
        for xor in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= xor
            try:
                yield i, xor, _reseal(bad, hdr)
            except errors.DeltaError:
                continue  # the fixed header no longer parses


def _resealed_flips(parent, data: bytes, hdr: record.RecordHeader, want: np.ndarray, live: np.ndarray,
                    start: int = 0) -> tuple[list[int], int]:
    """Flip each byte of ``data`` from ``start`` (0x01, 0x80, 0xFF; not the checksums, which resealing
    recomputes), reseal, decode on ``parent``: a DeltaError (then an in-place apply on ``live`` must leave it
    as it was) or ``want`` exactly. Returns the offsets that decoded, and how many failed applies had to undo."""
    decoded_ok, undone = [], 0
    for i, xor, sealed in _flips(data, hdr, start):
        try:
            out = codec.decode(parent, sealed)
        except errors.DeltaError:
            undone += _apply_leaves_live_untouched(sealed, live, i, want)
            continue
        got = out.numpy() if isinstance(out, torch.Tensor) else out
        np.testing.assert_array_equal(np.ascontiguousarray(got).reshape(-1).view(np.uint32),
                                      want.view(np.uint32), err_msg=f"byte {i} xor {xor:#x}: wrong tensor")
        decoded_ok.append(i)
    return decoded_ok, undone


def _apply_leaves_live_untouched(data: bytes, parent: np.ndarray, i: int, want: np.ndarray) -> int:
    """apply_ writes in place and undoes on a digest mismatch: the live tensor must come back bit for bit,
    or, where the apply succeeds, be the record's tensor exactly (a record that claims a parent but whose
    chunks are all raw rebuilds the same bits on any tensor: the result's digest proves them). Returns how
    many applies got as far as writing (and so had to undo)."""
    undone = 0
    for live in (parent.copy(), torch.from_numpy(parent.copy())):
        try:
            codec.apply_(live, data)
        except errors.DeltaError as e:
            undone += "left unchanged" in str(e)
            bits = live.numpy() if isinstance(live, torch.Tensor) else live
            np.testing.assert_array_equal(bits.view(np.uint32), parent.view(np.uint32),
                                          err_msg=f"byte {i}: live changed")
            continue
        bits = live.numpy() if isinstance(live, torch.Tensor) else live
        np.testing.assert_array_equal(bits.view(np.uint32), want.view(np.uint32), err_msg=f"byte {i}: wrong tensor")
    return undone


# --- the attack files ------------------------------------------------------------------------

def _expected() -> dict:
    return json.loads((ATTACKS / "EXPECTED.json").read_text())


def test_attack_files_match_their_generator():
    on_disk = {p.name for p in ATTACKS.iterdir() if p.suffix in (".ckdt", ".ckd", ".json")} - {"EXPECTED.json"}
    generated = make_attacks.attacks()
    assert on_disk == set(generated) == set(_expected())
    for fname, (data, spec) in generated.items():
        assert (ATTACKS / fname).read_bytes() == data, f"{fname} differs from make_attacks.py: rerun it"
        assert _expected()[fname] == spec


def _run_attack(fname: str, spec: dict):
    data = (ATTACKS / fname).read_bytes()
    if spec["kind"] == "record":
        parent = None
        if spec["parent"]:
            dt_name, shape = spec["parent"]
            parent = torch.zeros(shape, dtype=dtypes.BY_NAME[dt_name].torch_dtype)
        codec.decode(parent, data)
    elif spec["kind"] == "object":
        container.read_index(data, len(data))
    else:
        Manifest.from_json(data, run_id=spec["run_id"])


@pytest.mark.parametrize("fname", sorted(_expected()))
def test_attack_file_is_rejected_with_its_error_before_allocating(fname):
    spec = _expected()[fname]
    tracemalloc.start()
    try:
        with pytest.raises(errors.CkptDeltaError) as info:
            _run_attack(fname, spec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(info.value).__name__ == spec["error"], f"{fname}: {info.value!r}"
    if spec["kind"] in ("record", "object"):
        assert isinstance(info.value, errors.DeltaError)
    assert peak < MAX_PEAK, f"{fname}: {peak} bytes allocated while rejecting it"


# --- forged headers ----------------------------------------------------------------------------

def _rejects_small(data: bytes, parent=None) -> errors.CkptDeltaError:
    tracemalloc.start()
    try:
        with pytest.raises(errors.DeltaError) as info:
            codec.decode(parent, data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_PEAK, f"{peak} bytes allocated for {info.value!r}"
    return info.value


@pytest.mark.parametrize("shape,numel,chunk_elems,n_chunks", [
    ((1 << 44,), 1 << 44, 1 << 24, 1 << 20),          # a complete-looking header with no chunk table behind it
    ((1 << 47,), 1 << 47, 1 << 24, 1 << 23),          # too many chunks
    (((1 << 48) + 1,), (1 << 48) + 1, 1 << 24, 1 << 20),  # over the element limit
    ((0, 1 << 63), 0, 16, 0),                         # zero elements, but a dimension no tensor can have
    ((1 << 32, 1 << 32), 0, 16, 0),                   # shape product does not match numel
    ((4,), 4, 0, 0),                                  # chunk size 0
    ((4,), 4, (1 << 24) + 1, 0),                      # chunk size over the limit
    ((1 << 40,), 1 << 40, 1, 1 << 20),                # numel and chunk count disagree
])
def test_hostile_header_fields_are_rejected_before_allocation(shape, numel, chunk_elems, n_chunks):
    data = make_attacks.forge_header(shape=shape, numel=numel, chunk_elems=chunk_elems, n_chunks=n_chunks)
    e = _rejects_small(data + b"\0" * 4096)
    assert isinstance(e, (errors.FormatError, errors.TruncatedError))


def test_hostile_zstd_frame_is_rejected_before_decompressing():
    for frame in (make_attacks.frame_header_only(1 << 40), make_attacks.frame_header_only(1 << 62),
                  make_attacks.frame_header_only(15), b"", b"\x28\xb5\x2f\xfd"):
        data = make_attacks.forge_header(entries=[make_attacks.raw_chunk(frame, 4)]) + frame
        e = _rejects_small(data)
        assert isinstance(e, errors.FormatError) and "chunk 0" in str(e) and "'w'" in str(e)


def test_parentless_numel_bomb_is_rejected_before_allocating_the_tensor():
    """8 GiB declared, 19 KB delivered: every frame is vetted before the output is allocated."""
    e = _rejects_small((ATTACKS / "record_numel_bomb_without_parent.ckdt").read_bytes())
    assert "cannot hold" in str(e)


def test_header_claims_are_checked_against_the_parent_before_decoding():
    """A header that claims a huge tensor cannot make stage() allocate: the live tensor's shape rules."""
    n = 1 << 33
    data = make_attacks.forge_header(dtype_code=make_attacks.U8, shape=(n,), chunk_elems=1 << 24, flags=1,
                                     entries=[make_attacks.chunk_entry(record.UNCHANGED, 0, 0, 0, 0,
                                                                       xxhash.xxh3_64_intdigest(b""))] * (n >> 24))
    with pytest.raises(errors.ShapeMismatchError):
        codec.stage(np.zeros(16, np.uint8), data)


def test_unknown_dtype_code_is_a_format_error_naming_the_tensor():
    e = _rejects_small(make_attacks.forge_header(dtype_code=200, name="emb"))
    assert isinstance(e, errors.FormatError) and "emb" in str(e) and "200" in str(e)


def test_reserved_bytes_must_be_zero():
    payload = make_attacks.zstd_frame(bytes(16))
    entry = make_attacks.raw_chunk(payload, 4)
    bad_entry = entry[:3] + b"\x01" + entry[4:]
    for data in (make_attacks.forge_header(reserved=1, entries=[entry]) + payload,
                 make_attacks.forge_header(entries=[bad_entry]) + payload):
        with pytest.raises(errors.FormatError, match="reserved"):
            codec.decode(None, data)


def test_chunk_entries_inconsistent_with_their_chunk_are_rejected():
    u = make_attacks.U8
    cases = [
        (record.UNCHANGED, 0, 1, 0, 0),    # unchanged with planes
        (record.UNCHANGED, 0, 0, 1, 0),    # unchanged with a count
        (record.SPARSE, 0, 1, 1, 10),      # sparse with 0 gap planes
        (record.SPARSE, 5, 1, 1, 10),      # more gap planes than a u32
        (record.SPARSE, 1, 2, 1, 10),      # more step planes than the dtype is wide
        (record.SPARSE, 1, 1, 17, 10),     # more changes than elements
        (record.DENSE_XOR, 0, 1, 0, 10),   # dense with no change
        (record.DENSE_XOR, 0, 2, 1, 10),   # dense planes != width
        (record.DENSE_STEP, 0, 1, 0, 10),  # dense steps with no change
        (record.DENSE_STEP, 1, 1, 1, 10),  # dense steps with gap planes
        (record.DENSE_STEP, 0, 2, 1, 10),  # more step planes than the dtype is wide
        (record.DENSE_STEP, 0, 1, 17, 10),  # more changes than elements
        (record.RAW, 0, 1, 15, 10),        # raw count != chunk elements
        (4, 0, 1, 1, 10),                  # an encoding id this reader does not know
    ]
    for enc, pa, pb, count, length in cases:
        data = make_attacks.forge_header(dtype_code=u, shape=(16,), flags=1, entries=[
            make_attacks.chunk_entry(enc, pa, pb, count, length, 0)]) + b"\0" * length
        with pytest.raises(errors.FormatError, match="chunk 0"):
            codec.decode(np.zeros(16, np.uint8), data)


# --- delta objects --------------------------------------------------------------------------------

def _object() -> tuple[bytes, dict]:
    bio = io.BytesIO()
    w = container.ObjectWriter(bio)
    recs = {}
    for i in range(3):
        a = np.arange(10 + i, dtype=np.float32)
        recs[f"t{i}"] = codec.encode(a, a + 1, name=f"t{i}").to_bytes()
        w.add(f"t{i}", recs[f"t{i}"])
    size = w.finish()
    data = bio.getvalue()
    assert size == len(data)
    return data, recs


def test_object_index_round_trips_and_points_at_each_record():
    data, recs = _object()
    n = container.footer_length(data[-container.TRAILER.size:])
    index = container.read_index(data[-(n + container.TRAILER.size):], len(data))
    assert set(index) == set(recs)
    for name, (off, length) in index.items():
        assert data[off:off + length] == recs[name]
        assert codec.EncodedTensor.from_bytes(data[off:off + length]).name == name


def test_writing_a_tensor_twice_into_one_object_is_refused():
    w = container.ObjectWriter(io.BytesIO())
    w.add("t0", b"x")
    with pytest.raises(errors.FormatError, match="t0"):
        w.add("t0", b"y")


def test_every_flip_and_truncation_of_an_object_tail_is_rejected():
    data, _ = _object()
    n = container.footer_length(data[-container.TRAILER.size:])
    tail_start = len(data) - n - container.TRAILER.size
    for i in range(tail_start, len(data)):
        for xor in (0x01, 0xFF):
            bad = bytearray(data)
            bad[i] ^= xor
            with pytest.raises(errors.DeltaError):
                container.read_index(bytes(bad), len(bad))
    for k in range(len(data)):
        with pytest.raises(errors.DeltaError):
            container.read_index(data[:k], k)
    for m in range(container.TRAILER.size, n + container.TRAILER.size):  # too little of the tail fetched
        with pytest.raises(errors.TruncatedError):
            container.read_index(data[-m:], len(data))


def test_object_index_entries_must_fit_the_object_size_given():
    data, _ = _object()
    with pytest.raises(errors.FormatError, match="out of bounds"):
        container.read_index(data, len(data) - 200)  # an object shorter than its index says
