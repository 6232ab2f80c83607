"""Malformed records, delta objects and manifests, kept as files (like safetensors' attacks/).

    python -m tests.attacks.make_attacks        # (re)writes every file and EXPECTED.json

Each file is built by hand from docs/FORMAT.md with *valid* checksums where a
checksum would otherwise hide the flaw, so the reader's field checks (not just
its digests) are what reject it. tests/delta/test_codec_corruption.py loads every file
listed in EXPECTED.json and asserts it fails with exactly the error class named
there; the forging helpers are shared with that test.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import xxhash
import zstandard

from ckptdelta.delta import container, record

HERE = Path(__file__).resolve().parent
F32, U8 = 9, 2


# --- forging ---------------------------------------------------------------------------

def chunk_entry(enc: int, pa: int, pb: int, count: int, length: int, checksum: int, reserved: int = 0) -> bytes:
    return struct.pack("<BBBBIQQ", enc, pa, pb, reserved, count, length, checksum)


def forge_header(*, name: str = "w", dtype_code: int = F32, shape: tuple[int, ...] = (4,), numel: int | None = None,
                 chunk_elems: int = 16, flags: int = 0, digest: int = 0, parent_digest: int = 0,
                 n_chunks: int | None = None, entries: list[bytes] = (), magic: bytes = record.MAGIC,
                 version: int = record.FORMAT_VERSION, reserved: int = 0, name_len: int | None = None,
                 ndim: int | None = None, checksum: bool = True) -> bytes:
    """A record header with any field set to anything, and (by default) a correct header checksum."""
    nb = name.encode("utf-8")
    numel = math.prod(shape) if numel is None else numel
    n_chunks = len(entries) if n_chunks is None else n_chunks
    body = struct.pack("<4sHBBIIQQQIHH", magic, version, dtype_code, len(shape) if ndim is None else ndim, flags,
                       chunk_elems, numel, digest, parent_digest, n_chunks,
                       len(nb) if name_len is None else name_len, reserved)
    body += struct.pack(f"<{len(shape)}Q", *shape) + nb + b"\0" * (-len(nb) % 8) + b"".join(entries)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body) if checksum else 0)


def raw_chunk(payload: bytes, count: int, width: int = 4) -> bytes:
    """A RAW chunk entry whose length and checksum match ``payload``."""
    return chunk_entry(record.RAW, 0, width, count, len(payload), xxhash.xxh3_64_intdigest(payload))


def zstd_frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)


def frame_header_only(content_size: int) -> bytes:
    """The first bytes of a zstd frame declaring ``content_size`` (8-byte size field), then nothing."""
    fhd = 0b11_1_0_0_0_00  # FCS 8 bytes, single segment, no checksum, no dict id
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", content_size)


def footer_object(footer: bytes, records: bytes = b"", *, n: int | None = None, checksum: int | None = None,
                  end_magic: bytes = container.END_MAGIC) -> bytes:
    """A delta object with the given footer bytes (and, by default, a correct trailer)."""
    h = xxhash.xxh3_64_intdigest(footer) if checksum is None else checksum
    return container.OBJECT_MAGIC + records + footer + container.TRAILER.pack(
        len(footer) if n is None else n, h, end_magic)


def valid_manifest() -> dict:
    """A small valid delta manifest, as a dict to break one field at a time."""
    return {
        "format": "ckptdelta-manifest", "schema_version": 1, "name": "v00000002", "run_id": "run-expected",
        "version": 2, "kind": "delta", "parent_version": 1, "anchor_version": 0,
        "created": "2024-06-01T00:00:00.000Z", "step": 20, "writer_id": "0123abcd",
        "objects": [{"key": "deltas/000000000002-0123abcd/rank-00000.ckd", "size": 1000, "xxh3": "00112233445566ff"}],
        "extra_files": [],
        "tensors": {
            "w": {"dtype": "BF16", "shape": [10, 20], "xxh3": "0123456789abcdef", "object": 0, "offset": 8,
                  "length": 200},
            "b": {"dtype": "F32", "shape": [20], "xxh3": "fedcba9876543210", "object": None, "offset": 0,
                  "length": 0},
        },
        "metadata": {"note": "x"}, "full_bytes": 480, "stored_bytes": 1000,
    }


def manifest_bytes(**changes) -> bytes:
    d = valid_manifest()
    for path, value in changes.items():
        node, keys = d, path.split("__")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[keys[-1]] = value
    return json.dumps(d).encode()


# --- the attacks --------------------------------------------------------------------------

def attacks() -> dict[str, tuple[bytes, dict]]:
    """filename -> (bytes, expectation). ``kind`` says which reader gets the file;
    ``parent`` (records) is the dtype/shape of a zero tensor to decode against."""
    out: dict[str, tuple[bytes, dict]] = {}

    def rec(fname, data, error, parent=None):
        out[fname] = (data, {"kind": "record", "error": error, "parent": parent})

    good_payload = zstd_frame(bytes(16))
    good = forge_header(entries=[raw_chunk(good_payload, 4)], digest=xxhash.xxh3_64_intdigest(bytes(16))) + good_payload
    rec("record_bad_magic.ckdt", b"XXXX" + good[4:], "FormatError")
    rec("record_future_version.ckdt", good[:4] + struct.pack("<H", 2) + good[6:], "FormatError")
    rec("record_truncated_fixed_header.ckdt", good[:40], "TruncatedError")
    rec("record_header_checksum.ckdt", good[:30] + bytes([good[30] ^ 1]) + good[31:], "ChecksumError")
    rec("record_unknown_dtype_code.ckdt",
        forge_header(dtype_code=99, entries=[raw_chunk(good_payload, 4)]) + good_payload, "FormatError")
    rec("record_unknown_flags.ckdt", forge_header(flags=0x80, entries=[raw_chunk(good_payload, 4)]) + good_payload,
        "FormatError")
    rec("record_reserved_nonzero.ckdt", forge_header(reserved=7, entries=[raw_chunk(good_payload, 4)]) + good_payload,
        "FormatError")
    rec("record_chunk_elems_zero.ckdt", forge_header(chunk_elems=0, n_chunks=0), "FormatError")
    rec("record_chunk_elems_over_limit.ckdt",
        forge_header(chunk_elems=record.MAX_CHUNK_ELEMS + 1, entries=[raw_chunk(good_payload, 4)]), "FormatError")
    rec("record_numel_not_shape.ckdt", forge_header(shape=(2, 3), numel=5, n_chunks=1,
                                                    entries=[raw_chunk(good_payload, 5)]), "FormatError")
    rec("record_huge_dim_zero_numel.ckdt", forge_header(shape=(0, 1 << 63), numel=0), "FormatError")
    rec("record_huge_numel_no_chunk_table.ckdt",
        forge_header(shape=(1 << 44,), chunk_elems=1 << 24, n_chunks=1 << 20)[:record.FIXED_SIZE + 64],
        "TruncatedError")
    rec("record_too_many_chunks.ckdt", forge_header(shape=(1 << 47,), chunk_elems=1 << 24, n_chunks=1 << 23)[:200],
        "FormatError")
    rec("record_payload_length_huge.ckdt",
        forge_header(entries=[chunk_entry(record.RAW, 0, 4, 4, 1 << 62, 0)]) + good_payload, "TruncatedError")
    rec("record_payload_flip.ckdt", good[:-3] + bytes([good[-3] ^ 0x10]) + good[-2:], "ChecksumError")
    rec("record_trailing_bytes.ckdt", good + b"\0", "FormatError")
    bomb = frame_header_only(1 << 40)
    rec("record_zstd_frame_declares_1tib.ckdt", forge_header(entries=[raw_chunk(bomb, 4)]) + bomb, "FormatError")
    lie = zstd_frame(bytes(15))
    rec("record_zstd_frame_wrong_size.ckdt", forge_header(entries=[raw_chunk(lie, 4)]) + lie, "FormatError")
    # a parentless record claiming 8 GiB of raw chunks, each "payload" a bare frame header declaring 16 MiB
    ce, n = 1 << 24, 1 << 33
    frame = frame_header_only(ce)
    entries = [raw_chunk(frame, ce, 1)] * (n // ce)
    rec("record_numel_bomb_without_parent.ckdt",
        forge_header(dtype_code=U8, shape=(n,), chunk_elems=ce, entries=entries) + frame * (n // ce), "FormatError")
    # sparse chunk whose gaps point past its 16 elements (checksums valid)
    gaps, steps = zstd_frame(bytes([200])), zstd_frame(bytes([2]))
    sp = struct.pack("<I", len(gaps)) + gaps + steps
    rec("record_sparse_position_outside_chunk.ckdt",
        forge_header(dtype_code=U8, shape=(16,), flags=1, parent_digest=xxhash.xxh3_64_intdigest(bytes(16)),
                     entries=[chunk_entry(record.SPARSE, 1, 1, 1, len(sp), xxhash.xxh3_64_intdigest(sp))]) + sp,
        "FormatError", parent=["U8", [16]])
    sp2 = struct.pack("<I", 1 << 30) + gaps + steps
    rec("record_sparse_stream_length_lie.ckdt",
        forge_header(dtype_code=U8, shape=(16,), flags=1, parent_digest=xxhash.xxh3_64_intdigest(bytes(16)),
                     entries=[chunk_entry(record.SPARSE, 1, 1, 1, len(sp2), xxhash.xxh3_64_intdigest(sp2))]) + sp2,
        "FormatError", parent=["U8", [16]])
    xor = zstd_frame(bytes([1, 1, 1] + [0] * 13))
    rec("record_dense_count_lie.ckdt",
        forge_header(dtype_code=U8, shape=(16,), flags=1, parent_digest=xxhash.xxh3_64_intdigest(bytes(16)),
                     entries=[chunk_entry(record.DENSE_XOR, 0, 1, 2, len(xor), xxhash.xxh3_64_intdigest(xor))]) + xor,
        "FormatError", parent=["U8", [16]])
    rec("record_sparse_without_parent.ckdt",
        forge_header(dtype_code=U8, shape=(16,),
                     entries=[chunk_entry(record.SPARSE, 1, 1, 1, len(sp), xxhash.xxh3_64_intdigest(sp))]) + sp,
        "FormatError")
    steps16 = zstd_frame(bytes([2] * 16))
    rec("record_grouped_step_of_an_integer_dtype.ckdt",          # encodings 8 and 9 classify by an exponent field
        forge_header(dtype_code=U8, shape=(16,), flags=1, parent_digest=xxhash.xxh3_64_intdigest(bytes(16)),
                     entries=[chunk_entry(record.GROUPED_STEP, 0, 1, 16, len(steps16),
                                          xxhash.xxh3_64_intdigest(steps16))]) + steps16,
        "FormatError", parent=["U8", [16]])
    rec("record_grouped_step_count_lie.ckdt",                   # 16 steps of 2 against a header that says 3
        forge_header(flags=1, shape=(16,), parent_digest=xxhash.xxh3_64_intdigest(bytes(64)),
                     entries=[chunk_entry(record.GROUPED_STEP, 0, 1, 3, len(steps16),
                                          xxhash.xxh3_64_intdigest(steps16))]) + steps16,
        "FormatError", parent=["F32", [16]])
    rec("record_unknown_encoding.ckdt",
        forge_header(flags=1, entries=[chunk_entry(200, 0, 4, 4, 0, xxhash.xxh3_64_intdigest(b""))]), "FormatError",
        parent=["F32", [4]])
    rec("record_digest_lie.ckdt", forge_header(entries=[raw_chunk(good_payload, 4)], digest=12345) + good_payload,
        "ChecksumError")
    rec("record_wrong_parent.ckdt",
        forge_header(dtype_code=U8, shape=(16,), flags=1, parent_digest=1,
                     entries=[chunk_entry(record.UNCHANGED, 0, 0, 0, 0, xxhash.xxh3_64_intdigest(b""))]),
        "ParentMismatchError", parent=["U8", [16]])

    def obj(fname, data, error):
        out[fname] = (data, {"kind": "object", "error": error})

    obj("object_bad_end_magic.ckd", footer_object(b'{"records":{}}', end_magic=b"CKDEND99"), "FormatError")
    obj("object_footer_checksum.ckd", footer_object(b'{"records":{}}', checksum=1), "ChecksumError")
    obj("object_footer_over_limit.ckd", footer_object(b"{}", n=container.MAX_FOOTER_BYTES + 1), "FormatError")
    obj("object_footer_longer_than_object.ckd", footer_object(b"{}", n=1000), "TruncatedError")
    obj("object_footer_not_json.ckd", footer_object(b"\xff\xfe{"), "FormatError")
    obj("object_footer_records_is_list.ckd", footer_object(b'{"records":[]}'), "FormatError")
    obj("object_footer_deeply_nested.ckd", footer_object(b"[" * 5000 + b"]" * 5000), "FormatError")
    obj("object_footer_entry_negative.ckd", footer_object(b'{"records":{"w":[8,-1]}}', b"\0" * 64), "FormatError")
    obj("object_footer_entry_bool.ckd", footer_object(b'{"records":{"w":[8,true]}}', b"\0" * 64), "FormatError")
    obj("object_footer_entry_past_end.ckd", footer_object(b'{"records":{"w":[8,65]}}', b"\0" * 64), "FormatError")
    obj("object_footer_entry_in_magic.ckd", footer_object(b'{"records":{"w":[0,8]}}', b"\0" * 64), "FormatError")
    obj("object_truncated_trailer.ckd", footer_object(b'{"records":{}}')[:-1], "FormatError")

    def man(fname, data, error):
        out[fname] = (data, {"kind": "manifest", "error": error, "run_id": "run-expected"})

    man("manifest_dotdot_key.json", manifest_bytes(objects__0__key="deltas/../../other-run/x.ckd"), "ManifestError")
    man("manifest_absolute_key.json", manifest_bytes(objects__0__key="/etc/passwd"), "ManifestError")
    man("manifest_backslash_key.json", manifest_bytes(objects__0__key="deltas\\..\\x"), "ManifestError")
    man("manifest_negative_size.json", manifest_bytes(objects__0__size=-1), "ManifestError")
    man("manifest_offset_beyond_object.json", manifest_bytes(tensors__w__offset=900), "ManifestError")
    man("manifest_object_index_out_of_range.json", manifest_bytes(tensors__w__object=3), "ManifestError")
    man("manifest_dtype_not_a_string.json", manifest_bytes(tensors__w__dtype=["BF16"]), "ManifestError")
    man("manifest_shape_too_big.json", manifest_bytes(tensors__w__shape=[1 << 30, 1 << 30]), "ManifestError")
    man("manifest_wrong_schema.json", manifest_bytes(schema_version=2), "ManifestError")
    man("manifest_other_run.json", manifest_bytes(run_id="some-other-run"), "RunMismatchError")
    man("manifest_deeply_nested.json", b"[" * 5000 + b"]" * 5000, "ManifestError")
    d = valid_manifest()
    d["tensors"]["\ud800"] = d["tensors"].pop("w")
    man("manifest_lone_surrogate_name.json", json.dumps(d).encode(), "ManifestError")
    man("manifest_not_utf8.json", b'{"format": "\xff"}', "ManifestError")
    return out


def main() -> int:
    expected = {}
    for fname, (data, spec) in sorted(attacks().items()):
        (HERE / fname).write_bytes(data)
        expected[fname] = spec
    (HERE / "EXPECTED.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"{len(expected)} attack files written under {HERE.name}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
