"""Records are laid out exactly as docs/FORMAT.md says, and the header arithmetic holds past 2^31.

An independent reader written from FORMAT.md alone (struct, zstandard, numpy:
no import from delta/ but the dtype table) decodes what the encoder writes, so
the document and the code cannot drift apart unnoticed.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
import zstandard

from ckptdelta.delta import codec, dtypes, record
from ckptdelta.delta.errors import FormatError, TruncatedError
from tests import naive, naive_ctx, naive_gctx
from tests.attacks import make_attacks


# --- a reader written from docs/FORMAT.md ----------------------------------------------------

def _planes(data: bytes, n: int, p: int) -> np.ndarray:
    """FORMAT.md "Byte planes": p planes of n bytes, plane i = byte i of every value."""
    b = np.frombuffer(data, np.uint8)
    assert b.shape[0] == n * p
    out = np.zeros(n, np.uint64)
    for i in range(p):
        out |= b[i * n:(i + 1) * n].astype(np.uint64) << np.uint64(8 * i)
    return out


def _zstd(frame: bytes, expected: int) -> bytes:
    assert zstandard.frame_content_size(frame) == expected  # "declares its content size"
    return zstandard.ZstdDecompressor().decompress(frame)


def format_md_decode(buf: bytes, parent_bits: np.ndarray | None):
    """Decode one record following FORMAT.md section 3 only. Returns (fields, new bits)."""
    (magic, version, code, ndim, flags, chunk_elems, numel, digest, parent_digest, n_chunks, name_len,
     reserved) = struct.unpack_from("<4sHBBIIQQQIHH", buf, 0)
    assert magic == b"CKDT" and version == 1 and reserved == 0 and flags in (0, 1)
    shape = struct.unpack_from(f"<{ndim}Q", buf, 48)
    off = 48 + 8 * ndim
    name = buf[off:off + name_len].decode()
    off += (name_len + 7) // 8 * 8
    header_size = 48 + 8 * ndim + (name_len + 7) // 8 * 8 + 24 * n_chunks + 8
    assert struct.unpack_from("<Q", buf, header_size - 8)[0] == xxhash.xxh3_64_intdigest(buf[:header_size - 8])
    dt = dtypes.BY_CODE[code]
    w = 8 * dt.itemsize
    assert int(np.prod(shape)) == numel and n_chunks == -(-numel // chunk_elems)
    if flags & 1:
        assert xxhash.xxh3_64_intdigest(parent_bits) == parent_digest
        new = parent_bits.copy()
    else:
        assert parent_digest == 0
        new = np.zeros(numel, dt.bits_dtype)
    pos = header_size
    encodings = []
    for i in range(n_chunks):
        enc, pa, pb, res, count, length, checksum = struct.unpack_from("<BBBBIQQ", buf, off + 24 * i)
        assert res == 0
        payload = buf[pos:pos + length]
        assert xxhash.xxh3_64_intdigest(payload) == checksum
        pos += length
        s, e = i * chunk_elems, min(numel, (i + 1) * chunk_elems)
        n = e - s
        encodings.append(enc)
        if enc == 0:
            assert count == length == 0
        elif enc == 1:
            (L,) = struct.unpack_from("<I", payload, 0)
            gaps = _planes(_zstd(payload[4:4 + L], count * pa), count, pa).astype(np.int64)
            steps = _planes(_zstd(payload[4 + L:], count * pb), count, pb)
            p = np.cumsum(gaps + 1) - 1  # p_j = p_{j-1} + g_j + 1, p_{-1} = -1
            assert p[-1] < n
            old = parent_bits[s:e][p]
            k = naive.key(old, w, dt.sign_magnitude).astype(object)
            z = steps.astype(object)
            mask = (1 << w) - 1
            d = [x >> 1 if x % 2 == 0 else mask - (x >> 1) for x in z]
            keys = np.array([(a + b) & mask for a, b in zip(k, d)], dtype=object).astype(np.uint64)
            new[s:e][p] = naive.unkey(keys, w, dt.sign_magnitude).astype(dt.bits_dtype)
        elif enc == 2:
            x = _planes(_zstd(payload, n * pb), n, pb).astype(dt.bits_dtype)
            assert pb == dt.itemsize and int(np.count_nonzero(x)) == count
            new[s:e] = parent_bits[s:e] ^ x
        elif enc == 3:
            assert count == n and pb == dt.itemsize
            new[s:e] = _planes(_zstd(payload, n * pb), n, pb).astype(dt.bits_dtype)
        elif enc in (4, 5):  # their own FORMAT.md readers: tests/naive_ctx.py, tests/naive_gctx.py
            p, v = (naive_ctx if enc == 4 else naive_gctx).decode(payload, parent_bits[s:e], count, dt.name)
            new[s:e][p] = np.array(v, dtype=dt.bits_dtype)
        else:
            raise AssertionError(f"unknown encoding {enc}")
    assert pos == len(buf)  # no holes, no overlaps, nothing after the last payload
    assert xxhash.xxh3_64_intdigest(new) == digest
    return dict(name=name, shape=shape, dtype=dt.name, encodings=encodings), new


@pytest.mark.parametrize("dtype", sorted(dtypes.BY_NAME))
def test_format_md_reader_decodes_what_the_encoder_writes(dtype):
    dt = dtypes.BY_NAME[dtype]
    rng = np.random.default_rng(dt.code)
    n = 400
    if dtype == "BOOL":
        old = rng.integers(0, 2, n, dtype=np.uint8)
    else:
        old = rng.integers(0, 1 << (8 * dt.itemsize), n, dtype=dt.bits_dtype, endpoint=False)
    new = old.copy()
    new[5] ^= 1                                              # chunk 0: sparse
    new[200:300] = (old[200:300] ^ 1) if dtype != "BOOL" else 1 - old[200:300]  # chunk 2: dense
    new[300:] = 0                                            # chunk 3: a reset
    to_t = lambda b: dtypes.from_bits(b.copy(), dt, (n,))  # noqa: E731
    enc = codec.encode(to_t(old), to_t(new), name=f"t.{dtype}", chunk_elems=100)
    fields, got = format_md_decode(enc.to_bytes(), old)
    np.testing.assert_array_equal(got, new)
    assert fields["name"] == f"t.{dtype}" and fields["shape"] == (n,) and fields["dtype"] == dtype
    assert fields["encodings"][1] == record.UNCHANGED and {record.SPARSE, record.GCTX} & set(fields["encodings"])
    _, raw = format_md_decode(codec.encode(None, to_t(new), name="r", chunk_elems=64).to_bytes(), None)
    np.testing.assert_array_equal(raw, new)


def test_fixed_header_fields_sit_at_their_documented_offsets():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = codec.encode(a, a + 1, name="héllo", chunk_elems=4).to_bytes()
    assert buf[0:4] == b"CKDT"
    assert struct.unpack_from("<H", buf, 4)[0] == 1
    assert buf[6] == dtypes.BY_NAME["F32"].code and buf[7] == 2
    assert struct.unpack_from("<I", buf, 8)[0] == 1           # has parent
    assert struct.unpack_from("<I", buf, 12)[0] == 4          # chunk_elems
    assert struct.unpack_from("<Q", buf, 16)[0] == 6          # numel
    assert struct.unpack_from("<Q", buf, 24)[0] == codec.digest(a + 1)
    assert struct.unpack_from("<Q", buf, 32)[0] == codec.digest(a)
    assert struct.unpack_from("<I", buf, 40)[0] == 2          # chunks
    assert struct.unpack_from("<H", buf, 44)[0] == len("héllo".encode())
    assert struct.unpack_from("<H", buf, 46)[0] == 0
    assert struct.unpack_from("<2Q", buf, 48) == (2, 3)
    assert buf[64:70] == "héllo".encode() and buf[70:72] == b"\0\0"
    assert record.peek_header_size(buf[:48]) == 48 + 16 + 8 + 2 * 24 + 8


# --- pack / parse ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["w", "model.layers.0.self_attn.q_proj.weight", "poids.ß.层", "x" * 4096])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 5), tuple([1] * 32), (7, 11)])
def test_headers_round_trip_through_bytes(name, shape):
    numel = int(np.prod(shape))
    ce = 5
    n_chunks = record.n_chunks_for(numel, ce)
    entries = tuple(record.ChunkEntry(record.RAW, 0, 2, min(ce, numel - i * ce), 10 + i, 99 + i) for i in range(n_chunks))
    h = record.RecordHeader(name, dtypes.BY_NAME["BF16"], shape, numel, ce, 123, 0, False, entries,
                            record.header_size_for(len(shape), len(name.encode()), n_chunks))
    buf = record.pack_header(h)
    assert len(buf) == h.header_size == record.peek_header_size(buf[:48])
    assert record.parse_header(buf + b"\0" * 7) == h
    with pytest.raises(TruncatedError):
        record.parse_header(buf[:-1])


def test_names_over_the_limit_are_refused_when_packing():
    a = np.zeros(2, np.float32)
    with pytest.raises(FormatError, match="too long"):
        codec.encode(a, a, name="x" * 4097).to_bytes()


def test_more_than_32_dimensions_are_refused():
    with pytest.raises(FormatError, match="ndim"):
        record.parse_header(make_attacks.forge_header(shape=(1,) * 33))


# --- beyond 2^31 elements (headers only: no tensor of that size is allocated) ----------------

@pytest.mark.parametrize("shape", [((1 << 31) + 16,), (3 * (1 << 32) + 5,), (1 << 16, 1 << 16, 3)])
def test_chunk_arithmetic_past_2_pow_31(shape):
    numel = int(np.prod(np.array(shape, dtype=object)))
    ce = 1 << 24
    n_chunks = record.n_chunks_for(numel, ce)
    last = numel - (n_chunks - 1) * ce
    empty = xxhash.xxh3_64_intdigest(b"")
    entries = [make_attacks.chunk_entry(record.UNCHANGED, 0, 0, 0, 0, empty)] * (n_chunks - 1)
    sparse_payload = b"\0" * 10
    entries.append(make_attacks.chunk_entry(record.SPARSE, 3, 1, last, 10, xxhash.xxh3_64_intdigest(sparse_payload)))
    buf = make_attacks.forge_header(dtype_code=dtypes.BY_NAME["U8"].code, shape=shape, chunk_elems=ce, flags=1,
                                    parent_digest=1, entries=entries) + sparse_payload
    h = record.parse_header(buf)
    assert h.numel == numel and len(h.chunks) == n_chunks
    assert h.chunk_range(n_chunks - 1) == ((n_chunks - 1) * ce, numel)
    assert h.chunk_range(n_chunks - 2) == ((n_chunks - 2) * ce, (n_chunks - 1) * ce)
    start = h.chunk_range(n_chunks - 1)[0]
    assert start >= 1 << 31 and isinstance(start, int)
    assert h.payload_offsets()[-1] == h.header_size and h.record_size == len(buf)
    enc = codec.EncodedTensor.from_bytes(buf)
    assert enc.encoding_counts() == {"unchanged": n_chunks - 1, "sparse": 1}
    local = np.array([0, last - 1], np.int64)
    glob = local + start  # what stage() does with a chunk's positions
    assert glob.dtype == np.int64 and glob.tolist() == [start, numel - 1]


def test_chunk_count_at_its_limit_is_accepted_and_one_more_is_not():
    at_limit = make_attacks.forge_header(dtype_code=2, shape=(record.MAX_CHUNKS,), chunk_elems=1,
                                         n_chunks=record.MAX_CHUNKS)
    assert record.peek_header_size(at_limit) == record.header_size_for(1, 1, record.MAX_CHUNKS)
    with pytest.raises(FormatError, match="chunks"):
        record.peek_header_size(make_attacks.forge_header(dtype_code=2, shape=(record.MAX_CHUNKS + 1,),
                                                          chunk_elems=1, n_chunks=record.MAX_CHUNKS + 1))
