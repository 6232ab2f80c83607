"""Hostile but well-formed-looking bucket objects, built from the format's grammar (docs/FORMAT.md), for
tests/system/test_fuzz_bucket_grammar.py.

The byte-level fuzzer (tests/system/test_fuzz_entry_points.py) flips bits, and a digest catches nearly every flip
before a parser sees it. Here each case rewrites one object as a writer of the bucket could -- a manifest, a
shard's safetensors header, a delta record's header or payload, a delta object's footer, HEAD, RUN.json,
the shard index, the extra files' names -- with values the grammar allows in form but not in meaning: deep
nesting, repeated keys, huge counts, lengths and shapes, negative and overflowing numbers, wrong types,
unicode oddities, keys leaving the run, names that clash. The object is then *resealed*: its size and xxh3
written into every manifest that lists it, and each rewritten manifest's digest into HEAD, so the hostile
structure reaches the parser that reads it rather than stopping at a digest.

Strategies draw with hypothesis (``st.data()``), so a failing case shrinks to a small one.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import xxhash
from hypothesis import strategies as st

from ckptdelta.delta import container, dtypes, record
from ckptdelta.delta.manifest import HEAD_KEY, RUN_KEY, manifest_key

# --- JSON with raw fragments and repeated keys --------------------------------------------------------------


class Raw(str):
    """JSON text spliced in as it is (deep nesting, numbers json.dumps would not write)."""


class Pairs(list):
    """A JSON object as (key, value) pairs, so that a key can repeat."""


def dump(v: object, *, ascii_only: bool = True) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, dict):
        v = Pairs(v.items())
    if isinstance(v, Pairs):
        return "{" + ",".join(f"{dump(k, ascii_only=ascii_only)}:{dump(x, ascii_only=ascii_only)}"
                              for k, x in v) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(dump(x, ascii_only=ascii_only) for x in v) + "]"
    return json.dumps(v, ensure_ascii=ascii_only)


def encode(text: str) -> bytes:
    """UTF-8, lone surrogates kept (as invalid UTF-8 a reader must refuse)."""
    return text.encode("utf-8", "surrogatepass")


def nodes(doc: object, path: tuple = ()) -> list[tuple[tuple, object]]:
    """(path, value) of every node below the root."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append((path + (k,), v))
        out.extend(nodes(v, path + (k,)))
    return out


def set_at(doc: object, path: tuple, value: object) -> None:
    for p in path[:-1]:
        doc = doc[p]
    doc[path[-1]] = value


def deep(depth: int, kind: str = "[") -> Raw:
    if kind == "[":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "0" + "}" * depth)


ODD_SCALARS = [None, True, False, 0, -1, 1.5, -0.0, "", "x", 2 ** 62, 2 ** 62 - 1, 2 ** 63, 2 ** 64, -(2 ** 63),
               10 ** 30, 1e308, Raw("1e99999"), Raw("-0"), Raw("NaN"), Raw("Infinity"), Raw("1" * 5000),
               "\udc80", "\u202egpj.exe", "\x00", "\ufeff", "é", "😀", "../../escape", "/etc/passwd", "C:\\x",
               "a/b", [], {}, [1, 2], {"a": 1}]


def hostile_values() -> st.SearchStrategy:
    """A value that fits nowhere a reader expects it, or fits too well (huge, deep, many)."""
    return st.one_of(
        st.sampled_from(ODD_SCALARS),
        st.builds(deep, st.integers(17, 20000), st.sampled_from("[{")),
        st.integers(-(2 ** 70), 2 ** 70),
        st.text(max_size=12),
        st.integers(256, 20000).map(lambda n: "a" * n),
        st.integers(1000, 100000).map(lambda n: Raw("[" + ",".join(["0"] * n) + "]")),
        st.builds(lambda n, v: [v] * n, st.integers(2, 40), st.sampled_from([0, 2 ** 47, -1, 1.0, True, "1"])),
    )


@st.composite
def mutate_json(draw, doc: object) -> tuple[str, object]:
    """One grammar-level change to a parsed JSON document: a node replaced by a hostile value, a key repeated,
    the whole document nested or replaced. Returns (what, new document) -- dump() it."""
    doc = json.loads(json.dumps(doc))
    op = draw(st.sampled_from(["replace", "replace", "replace", "repeat", "wrap", "root"]))
    ns = nodes(doc)
    if op == "replace" and ns:
        path, _ = draw(st.sampled_from(ns))
        value = draw(hostile_values())
        set_at(doc, path, value)
        return f"{'/'.join(map(str, path))} = {str(value)[:60]!r}", doc
    objects = [(p, v) for p, v in [((), doc)] + ns if isinstance(v, dict) and v]
    if op == "repeat" and objects:
        path, obj = draw(st.sampled_from(objects))
        key = draw(st.sampled_from(sorted(obj)))
        pairs = Pairs(obj.items())
        pairs.insert(draw(st.integers(0, len(pairs))), (key, draw(st.one_of(st.just(obj[key]), hostile_values()))))
        if path:
            set_at(doc, path, pairs)
        else:
            doc = pairs
        return f"key {'/'.join(map(str, path + (key,)))} repeated", doc
    if op == "wrap":
        depth = draw(st.integers(1, 3000))
        return f"document nested {depth} levels down", Raw("[" * depth + dump(doc) + "]" * depth)
    value = draw(hostile_values())
    return f"document replaced by {str(value)[:60]!r}", value


# --- the bucket, resealed after each change ------------------------------------------------------------------


@dataclass
class Bucket:
    """A run's objects by key, changed in memory, then written to a directory."""

    files: dict[str, bytes]
    changed: list[str] = field(default_factory=list)

    def copy(self) -> "Bucket":
        return Bucket(dict(self.files))

    def manifest_keys(self) -> list[str]:
        return sorted(k for k in self.files if k.startswith("manifests/"))

    def doc(self, key: str) -> object:
        return json.loads(self.files[key])

    def put(self, key: str, data: bytes) -> None:
        self.files[key] = data
        self.changed.append(key)

    def reseal(self, key: str) -> None:
        """``key``'s size and xxh3 into every manifest that lists it; then those manifests into HEAD."""
        data = self.files[key]
        for mk in self.manifest_keys():
            try:
                d = self.doc(mk)
            except ValueError:
                continue
            hit = False
            for o in [*_list(d, "objects"), *_list(d, "extra_files")]:
                if isinstance(o, dict) and o.get("key") == key:
                    o["size"], o["xxh3"] = len(data), _xxh(data)
                    hit = True
            if hit:
                self.files[mk] = json.dumps(d).encode()
                self.reseal_head(mk)

    def reseal_head(self, manifest: str) -> None:
        """HEAD's digest of ``manifest``, if HEAD names it (verify checks it before anything else)."""
        try:
            head = json.loads(self.files[HEAD_KEY])
            if manifest_key(head["version"]) == manifest:
                head["manifest_xxh3"] = _xxh(self.files[manifest])
                self.files[HEAD_KEY] = json.dumps(head).encode()
        except (ValueError, KeyError, TypeError):
            pass

    def write(self, root: str) -> None:
        for key, data in self.files.items():
            path = os.path.join(root, *key.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)


def _list(d: object, k: str) -> list:
    v = d.get(k) if isinstance(d, dict) else None
    return v if isinstance(v, list) else []


def _xxh(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


@dataclass
class Case:
    kind: str
    key: str         # the object changed first (the one a message should name, or its snapshot)
    what: str
    bucket: Bucket
    #: Whether the change may leave a snapshot that reads back, with other content than the pristine one
    #: (a resealed manifest is the truth by definition): then only its own claims are checked.
    meaning_may_change: bool = False

    def __str__(self) -> str:
        return f"{self.kind} {self.key}: {self.what}"[:400]


# --- manifests ----------------------------------------------------------------------------------------------


def extra_key_variants(prefix: str, names: list[str]) -> list[tuple[str, str]]:
    """(what, key) of extra-file keys that clash with ``names``, leave the run, or cannot name a local file."""
    first = names[0]
    nested = next((n for n in names if "/" in n), None)
    out = [
        ("a file that is also a directory", f"{prefix}/{first}/x"),
        ("the same name under another writer", f"anchors/000000000000-0000000000000000-9/{first}"),
        ("the same name again", f"{prefix}/{first}"),
        ("a name differing only in case", f"{prefix}/{first.upper()}"),
        ("a key with '..'", f"{prefix}/../../escape"),
        ("an absolute key", "/etc/passwd"),
        ("an empty segment", f"{prefix}//x"),
        ("a '.' segment", f"{prefix}/./x"),
        ("a backslash", f"{prefix}\\x"),
        ("a segment of 256 bytes", f"{prefix}/{'a' * 256}"),
        ("a key of 1100 bytes", prefix + "/a" * 530),
        ("a non-ASCII name", f"{prefix}/é.json"),
        ("a bidi override", f"{prefix}/\u202ex.json"),
        ("a NUL", f"{prefix}/x\x00.json"),
        ("the weights' name", f"{prefix}/model.safetensors"),
        ("below the index's name", f"{prefix}/model.safetensors.index.json/x"),
        ("below a shard's name", f"{prefix}/model-00001-of-00002.safetensors/x"),
        ("a key outside any snapshot", "HEAD"),
    ]
    if nested is not None:
        out.append(("a file named like another's directory", f"{prefix}/{nested.split('/')[0]}"))
    return out


@st.composite
def manifest_cases(draw, pristine: Bucket, target: int,
                   ops: tuple[str, ...] = ("grammar", "grammar", "tensors", "shape", "range", "object keys"),
                   most_tensors: int = 2000) -> Case:
    b = pristine.copy()
    v = draw(st.sampled_from([0, 1, target, target]))
    mk = manifest_key(v)
    doc = b.doc(mk)
    op = draw(st.sampled_from(ops))
    meaning = False
    if op == "grammar":
        what, doc = draw(mutate_json(doc))
        meaning = True     # e.g. a dtype of the same width: only verify can tell (the shard header)
    elif op == "tensors":
        n = draw(st.sampled_from([1, 10, most_tensors]))
        name, entry = draw(st.sampled_from(sorted(doc["tensors"].items())))
        for i in range(n):
            doc["tensors"][f"{name}.copy{i}"] = dict(entry)
        what = f"{n} more tensors like {name!r}"
        meaning = True
    elif op == "shape":
        name = draw(st.sampled_from(sorted(doc["tensors"])))
        shape = draw(st.sampled_from([[2 ** 47, 2], [2 ** 24] * 3, [0, 2 ** 60], [-1], [1] * 33, [1.0], [True],
                                      [2 ** 48 + 1], [2 ** 64], [], [0], "16", None]))
        doc["tensors"][name]["shape"] = shape
        what = f"tensor {name!r} shape {shape}"
    elif op == "range":
        name = draw(st.sampled_from(sorted(doc["tensors"])))
        field_ = draw(st.sampled_from(["offset", "length", "object"]))
        value = draw(st.sampled_from([2 ** 62 - 1, 2 ** 62, 2 ** 40, 0, 1, -1, 7, 10 ** 12, None, "0", 1.0]))
        doc["tensors"][name][field_] = value
        what = f"tensor {name!r} {field_} {value!r}"
    elif op == "extra names":
        keys = [o["key"] for o in doc["extra_files"]]
        prefix = "/".join(keys[0].split("/")[:2])
        names = ["/".join(k.split("/")[2:]) for k in keys]
        variants = extra_key_variants(prefix, names)
        what_key, key = draw(st.sampled_from(variants))
        template = dict(doc["extra_files"][0])
        if draw(st.integers(0, 9)) == 0:
            doc["extra_files"] += [{**template, "key": f"{prefix}/many/{i}"} for i in range(4097)]
            what = "4097 more extra files"
        else:
            doc["extra_files"].append({**template, "key": key})
            what = f"extra file key {key[:80]!r} ({what_key})"
            if _local_path_ok(b, key):          # the object exists, so only the name can be refused
                b.files[key] = pristine.files[template["key"]]
        meaning = True     # a case-only clash is legal on a case-sensitive filesystem
    else:   # object keys
        i = draw(st.integers(0, len(doc["objects"]) - 1))
        key = draw(st.sampled_from(["../../escape", "/abs", "a//b", "x\x00", "é", "a" * 1100, "HEAD", RUN_KEY,
                                    manifest_key(0), doc["objects"][-1]["key"], 7, None]))
        doc["objects"][i]["key"] = key
        what = f"objects[{i}].key = {str(key)[:60]!r}"
    b.put(mk, encode(dump(doc, ascii_only=draw(st.booleans()))))
    b.reseal_head(mk)
    return Case("manifest", mk, what, b, meaning)


def _local_path_ok(b: Bucket, key: str) -> bool:
    """Whether ``key`` can be a file of the local bucket beside the others (no file/directory clash there)."""
    from ckptdelta.delta.manifest import is_safe_key
    if not is_safe_key(key):
        return False
    parts = key.split("/")
    dirs = {"/".join(parts[:i]) for i in range(1, len(parts))}
    return not any(k in dirs or k.startswith(key + "/") for k in b.files)


# --- safetensors shard headers -----------------------------------------------------------------------------


@st.composite
def shard_header_cases(draw, pristine: Bucket) -> Case:
    b = pristine.copy()
    key = draw(st.sampled_from(sorted(k for k in b.files if k.endswith(".safetensors"))))
    data = b.files[key]
    (n,) = struct.unpack_from("<Q", data, 0)
    header, body = json.loads(data[8: 8 + n]), data[8 + n:]
    op = draw(st.sampled_from(["grammar", "grammar", "fields", "deep", "length", "bytes"]))
    if op == "length":
        lie = draw(st.sampled_from([0, 1, n - 1, n + 8, len(data), len(data) - 8, 2 ** 63, 2 ** 64 - 1, 100 << 20]))
        b.put(key, struct.pack("<Q", lie) + data[8:])
        b.reseal(key)
        return Case("shard header", key, f"header length {lie} (is {n})", b)
    if op == "deep":
        depth = draw(st.integers(17, max(17, (n - 2) // 2)))
        text = encode(dump(deep(depth, draw(st.sampled_from("[{")))))
        what = f"header nested {depth} levels"
    elif op == "bytes":
        text = draw(st.sampled_from([b"\xff\xfe" + data[10: 8 + n], b"\xef\xbb\xbf" + data[8: 8 + n],
                                     data[8: 8 + n].replace(b'"BF16"', b'"\xc0\x80F"', 1), b"NaN", b"",
                                     data[8: 8 + n].replace(b"[", b"[" * 40, 1)]))
        what = f"header bytes {text[:40]!r}"
    elif op == "fields":
        name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field_ = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "entry", "metadata"]))
        value = draw(st.one_of(hostile_values(), st.sampled_from([
            [0, 2 ** 64], [5, 1], [-8, 0], [0.0, 8.0], [0], [0, 1, 2], "F16", "I16", "BF32", [2 ** 31, 2 ** 31]])))
        if field_ == "extra":
            header[name]["zz"] = value
        elif field_ == "entry":
            header[name] = value
        elif field_ == "metadata":
            header["__metadata__"] = value
        else:
            header[name][field_] = value
        text = encode(dump(header, ascii_only=draw(st.booleans())))
        what = f"header {name!r} {field_} = {str(value)[:60]!r}"
    else:
        what, doc = draw(mutate_json(header))
        text = encode(dump(doc, ascii_only=draw(st.booleans())))
    if len(text) <= n:
        text += b" " * (n - len(text))            # the data stays where the manifest says
        b.put(key, struct.pack("<Q", n) + text + body)
    else:                                         # a longer header moves the data: the manifest follows it
        text += b" " * (-len(text) % 8)
        b.put(key, struct.pack("<Q", len(text)) + text + body)
        _shift_tensors(b, key, len(text) - n)
    b.reseal(key)
    return Case("shard header", key, what, b)


def _shift_tensors(b: Bucket, key: str, by: int) -> None:
    for mk in b.manifest_keys():
        d = b.doc(mk)
        idx = [i for i, o in enumerate(d["objects"]) if o["key"] == key]
        if idx:
            for e in d["tensors"].values():
                if e["object"] == idx[0]:
                    e["offset"] += by
            b.files[mk] = json.dumps(d).encode()


# --- delta records and footers -------------------------------------------------------------------------------

_FIXED_FIELDS = ["magic", "version", "code", "ndim", "flags", "chunk_elems", "numel", "digest", "parent_digest",
                 "n_chunks", "name_len", "reserved"]
_FIXED_WIDTH = {"version": 16, "code": 8, "ndim": 8, "flags": 32, "chunk_elems": 32, "numel": 64, "digest": 64,
                "parent_digest": 64, "n_chunks": 32, "name_len": 16, "reserved": 16}
_CHUNK_FIELDS = ["encoding", "planes_a", "planes_b", "reserved", "count", "length", "checksum"]
_CHUNK_WIDTH = {"encoding": 8, "planes_a": 8, "planes_b": 8, "reserved": 8, "count": 32, "length": 64,
                "checksum": 64}


def _edge(width: int, old: int) -> st.SearchStrategy:
    top = (1 << width) - 1
    edges = {0, 1, 2, 32, 33, 4096, 4097, 1 << 20, (1 << 20) + 1, 1 << 24, (1 << 24) + 1, 1 << 48, (1 << 48) + 1,
             top, top - 1, top >> 1, max(0, old - 1), min(top, old + 1)}
    return st.one_of(st.sampled_from(sorted(x for x in edges if x <= top)), st.integers(0, top))


def zstd_frame(claimed: int, body: bytes = b"\0") -> bytes:
    """A zstd frame whose header claims ``claimed`` bytes of content, holding one raw block of ``body``."""
    fhd = 0xE0                                   # 8-byte content size, single segment, no checksum
    block = ((len(body) << 3) | 1).to_bytes(3, "little")   # last block, raw
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", claimed) + block + body


def _records(data: bytes) -> list[tuple[str, int, int]]:
    index = container.read_index(data, len(data))
    return sorted(((n, o, ln) for n, (o, ln) in index.items()), key=lambda r: r[1])


def _agree(b: Bucket, key: str, name: str, dtype: str, shape: list[int]) -> None:
    """The manifest entry of ``name``'s record in object ``key`` made to say ``dtype`` and ``shape``."""
    for mk in b.manifest_keys():
        d = b.doc(mk)
        idx = [i for i, o in enumerate(d["objects"]) if o["key"] == key]
        if idx and d["tensors"].get(name, {}).get("object") == idx[0]:
            d["tensors"][name]["dtype"], d["tensors"][name]["shape"] = dtype, shape
            b.files[mk] = json.dumps(d).encode()


def object_bytes(records: list[tuple[str, bytes]], footer: bytes | None = None,
                 trailer_ok: bool = True) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A delta object (docs/FORMAT.md, section 2) of (name, record bytes), and where each record lies in it."""
    out = bytearray(container.OBJECT_MAGIC)
    where = {}
    for name, rec in records:
        where[name] = (len(out), len(rec))
        out += rec
    if footer is None:
        footer = json.dumps({"records": {n: list(w) for n, w in where.items()}}, separators=(",", ":")).encode()
    out += footer
    h = xxhash.xxh3_64_intdigest(footer) ^ (0 if trailer_ok else 1)
    out += container.TRAILER.pack(len(footer), h, container.END_MAGIC)
    return bytes(out), where


def _rebuild_object(b: Bucket, key: str, records: list[tuple[str, bytes]], footer: bytes | None = None,
                    trailer_ok: bool = True) -> None:
    """The delta object ``key`` rewritten from (name, record bytes); every manifest entry into it follows."""
    out, where = object_bytes(records, footer, trailer_ok)
    b.put(key, out)
    for mk in b.manifest_keys():   # the manifests' entries follow the records (and were maybe changed above)
        d = b.doc(mk)
        idx = [i for i, o in enumerate(d["objects"]) if o["key"] == key]
        if idx:
            for name, e in d["tensors"].items():
                if e["object"] == idx[0] and name in where:
                    e["offset"], e["length"] = where[name]
            b.files[mk] = json.dumps(d).encode()
    b.reseal(key)


@st.composite
def record_cases(draw, pristine: Bucket) -> Case:
    b = pristine.copy()
    key = draw(st.sampled_from(sorted(k for k in b.files if k.endswith(".ckd"))))
    recs = records_of(b.files[key])
    i = draw(st.integers(0, len(recs) - 1))
    name = recs[i][0]
    rec, what, agreed = hostile_record(draw, recs, i)
    if agreed is not None:
        _agree(b, key, name, *agreed)
    recs[i] = (name, rec)
    _rebuild_object(b, key, recs)
    return Case("record", key, what, b, meaning_may_change=agreed is not None)


def records_of(data: bytes) -> list[tuple[str, bytes]]:
    """(name, record bytes) of a delta object, in their order in it."""
    return [(n, data[o: o + ln]) for n, o, ln in _records(data)]


def hostile_record(draw, recs: list[tuple[str, bytes]], i: int) -> tuple[bytes, str, tuple[str, list[int]] | None]:
    """Record ``i`` of ``recs`` rewritten as a writer of the bucket could (a header field, a shape, the name, a
    chunk entry or payload at an edge value), its header checksum resealed (but for a tenth of the fixed-field
    changes); the record, what was done, and (dtype name, shape) where the change was another dtype of the same
    width or a permuted shape, which the caller makes the reader's entry for it agree with."""
    name, rec = recs[i]
    rec = bytearray(rec)
    agreed = None
    fixed = dict(zip(_FIXED_FIELDS, record._FIXED.unpack_from(rec, 0)))
    ndim, name_len, n_chunks = fixed["ndim"], fixed["name_len"], fixed["n_chunks"]
    table = record.FIXED_SIZE + 8 * ndim + ((name_len + 7) & ~7)
    size = record.header_size_for(ndim, name_len, n_chunks)
    op = draw(st.sampled_from(["fixed", "fixed", "shape", "name", "chunk", "chunk", "payload", "agreed"]))
    reseal_checksum = True
    if op == "agreed":
        # the record and its manifest entry agree on another dtype of the same width, or a permuted shape, so
        # the change passes every comparison of the two and reaches the decode and the live tensor's checks
        width = dtypes.BY_CODE[fixed["code"]].itemsize
        shape = list(struct.unpack_from(f"<{ndim}Q", rec, record.FIXED_SIZE))
        others = sorted(d.code for d in dtypes.BY_CODE.values() if d.itemsize == width and d.code != fixed["code"])
        if ndim >= 2 and (not others or draw(st.booleans())):
            shape = shape[::-1]
            struct.pack_into(f"<{ndim}Q", rec, record.FIXED_SIZE, *shape)
        elif others:
            fixed["code"] = draw(st.sampled_from(others))
            record._FIXED.pack_into(rec, 0, *fixed.values())
        agreed = (dtypes.BY_CODE[fixed["code"]].name, shape)
        what = f"record {name!r} and its manifest entry both say {dtypes.BY_CODE[fixed['code']].name}{shape}"
    elif op == "fixed":
        f_ = draw(st.sampled_from(_FIXED_FIELDS))
        if f_ == "magic":
            fixed[f_] = draw(st.sampled_from([b"CKDX", b"\0\0\0\0", b"CKDO"]))
        else:
            fixed[f_] = draw(_edge(_FIXED_WIDTH[f_], fixed[f_]))
        record._FIXED.pack_into(rec, 0, *fixed.values())
        what = f"record {name!r} {f_} = {fixed[f_]!r}"
        reseal_checksum = draw(st.integers(0, 9)) > 0
    elif op == "shape" and ndim:
        d = draw(st.integers(0, ndim - 1))
        value = draw(_edge(64, struct.unpack_from("<Q", rec, record.FIXED_SIZE + 8 * d)[0]))
        struct.pack_into("<Q", rec, record.FIXED_SIZE + 8 * d, value)
        what = f"record {name!r} shape[{d}] = {value}"
    elif op == "name":
        new = draw(st.sampled_from([b"\xff" * name_len, b"\xc0\x80" + b"x" * (name_len - 2), b"\0" * name_len,
                                    recs[(i + 1) % len(recs)][0].encode()[:name_len].ljust(name_len, b"x")]))
        start = record.FIXED_SIZE + 8 * ndim
        rec[start: start + name_len] = new[:name_len]
        if draw(st.booleans()) and name_len % 8:
            rec[start + name_len] = 1                    # the padding, not zero
        what = f"record {name!r} name bytes {new[:20]!r}"
    elif op in ("chunk", "payload") and n_chunks:
        c = draw(st.integers(0, n_chunks - 1))
        at = table + record.CHUNK_ENTRY_SIZE * c
        entry = dict(zip(_CHUNK_FIELDS, record._CHUNK.unpack_from(rec, at)))
        if op == "chunk":
            f_ = draw(st.sampled_from(_CHUNK_FIELDS))
            entry[f_] = draw(_edge(_CHUNK_WIDTH[f_], entry[f_]))
            record._CHUNK.pack_into(rec, at, *entry.values())
            what = f"record {name!r} chunk {c} {f_} = {entry[f_]}"
        else:
            offsets = [size]
            for j in range(n_chunks):
                offsets.append(offsets[-1] + record._CHUNK.unpack_from(rec, table + record.CHUNK_ENTRY_SIZE * j)[5])
            payload = draw(st.sampled_from([zstd_frame(2 ** 40), zstd_frame(2 ** 62, b"\0" * 64), b"",
                                            zstd_frame(16), bytes(rec[offsets[c]: offsets[c + 1]])[:3],
                                            b"\0\0\0\0" + zstd_frame(2 ** 33), b"\xff" * 64]))
            rec[offsets[c]: offsets[c + 1]] = payload
            entry["length"], entry["checksum"] = len(payload), xxhash.xxh3_64_intdigest(payload)
            record._CHUNK.pack_into(rec, at, *entry.values())
            what = f"record {name!r} chunk {c} payload {payload[:24]!r}... ({len(payload)} bytes)"
    else:
        what = f"record {name!r} {op} (nothing to change): its header checksum broken"
        rec[size - 1] ^= 1
        reseal_checksum = False
    if reseal_checksum:     # so that the fields are what the reader judges
        size = record.header_size_for(fixed["ndim"], fixed["name_len"], fixed["n_chunks"])
        if 8 <= size <= len(rec):
            struct.pack_into("<Q", rec, size - 8, xxhash.xxh3_64_intdigest(bytes(rec[: size - 8])))
    return bytes(rec), what, agreed


@st.composite
def footer_cases(draw, pristine: Bucket) -> Case:
    b = pristine.copy()
    key = draw(st.sampled_from(sorted(k for k in b.files if k.endswith(".ckd"))))
    data = b.files[key]
    recs = [(n, data[o: o + ln]) for n, o, ln in _records(data)]
    index = {n: [o, ln] for n, o, ln in _records(data)}
    op = draw(st.sampled_from(["grammar", "grammar", "overlap", "many", "bytes"]))
    if op == "overlap":
        a, c = sorted(index)[:2]
        index[c] = list(index[a])
        footer = encode(dump({"records": index}))
        what = f"footer: {c!r} at {a!r}'s record"
    elif op == "many":
        n = draw(st.sampled_from([1000, 100000]))
        first = next(iter(index.values()))
        footer = encode(dump({"records": {**index, **{f"t{i}": [first[0], 0] for i in range(n)}}}))
        what = f"footer: {n} more entries"
    elif op == "bytes":
        footer = draw(st.sampled_from([b"\xff" * 16, b"", b"{}", encode(dump(deep(100000))), b'{"records":NaN}']))
        what = f"footer bytes {footer[:30]!r}"
    else:
        what, doc = draw(mutate_json({"records": index}))
        footer = encode(dump(doc, ascii_only=draw(st.booleans())))
        what = f"footer: {what}"
    _rebuild_object(b, key, recs, footer, trailer_ok=draw(st.integers(0, 9)) > 0)
    return Case("footer", key, what, b)


# --- HEAD, RUN.json, the shard index --------------------------------------------------------------------------


@st.composite
def pointer_cases(draw, pristine: Bucket, key: str) -> Case:
    b = pristine.copy()
    doc = b.doc(key)
    op = draw(st.sampled_from(["grammar", "grammar", "fields"]))
    meaning = False
    if op == "fields":
        field_ = draw(st.sampled_from(sorted(doc)))
        value = draw(st.one_of(st.sampled_from([0, 1, 3, 2 ** 62 - 1, "2", "0000000000000000", "DF6D1559991E6FEC",
                                                "run", "é" * 300]), hostile_values()))
        doc[field_] = value
        what = f"{field_} = {str(value)[:60]!r}"
        meaning = key == HEAD_KEY and field_ == "version"    # HEAD is a hint: another version is still a version
    else:
        what, doc = draw(mutate_json(doc))
        meaning = key == HEAD_KEY
    b.put(key, encode(dump(doc, ascii_only=draw(st.booleans()))))
    if key.endswith(".json") and key != RUN_KEY:     # the shard index: an object of the anchor
        b.reseal(key)
    kind = {HEAD_KEY: "HEAD", RUN_KEY: "RUN.json"}.get(key, "shard index")
    return Case(kind, key, what, b, meaning)


def index_key(b: Bucket) -> str:
    return next(k for k in b.files if k.endswith(".index.json"))
