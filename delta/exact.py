"""Exact attachments: the trainer's own bits of a snapshot that was published cast.

An fp32 trainer whose replicas serve bf16 publishes the bf16 cast (``Publisher(dtype=torch.bfloat16)``): a
vLLM replica keeps bf16 whatever it is sent, so every fp32 bit past the cast would cross the network for
nothing. ``keep_exact=True`` keeps the fp32 bits in the run all the same, as an attachment to each version,
written after its commit: replicas never wait for it, and a reader that needs the trainer's fp32 (an
evaluation, a peft replica, a resumed trainer) rebuilds it bit for bit (docs/FORMAT.md, "Exact
attachments").

Each fp32 tensor is one record (docs/FORMAT.md, section 3) coded against its published bf16 value widened
back to fp32. The two differ by the rounding alone, at most 2^15 ulps, so the record holds about two bytes
an element, and it needs nothing but the snapshot it belongs to: no attachment depends on another's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
import numpy as np

from ckptdelta.delta import untrusted_json
from ckptdelta.delta.errors import FormatError, RunMismatchError
from ckptdelta.delta.manifest import Manifest, ObjectRef
from ckptdelta.delta.record import max_record_size
from ckptdelta.delta.storage import check_key

EXACT_DIR = "exact"
FORMAT = "ckptdelta-exact"
SCHEMA_VERSION = 1
MAX_INDEX_BYTES = 64 << 20
MAX_OBJECTS = 1 << 16
#: an attachment is written in objects (parts) of about this many bytes: a writer holds one at a time
PART_BYTES = 64 << 20
#: the dtype a tensor is published in -> the dtype its exact bits are kept in (the widening docs/FORMAT.md defines)
WIDENS = {"BF16": "F32"}
#: object key of an attachment: its version, then the publish attempt's data id
OBJECT_KEY = re.compile(rf"^{EXACT_DIR}/(\d{{12}})-[0-9a-zA-Z-]+\.ckd$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def index_key(version: int) -> str:
    """The attachment's index: written last, create-only (its presence says the attachment is whole)."""
    return f"{EXACT_DIR}/{version:012d}.json"


def object_key(version: int, data_id: str, part: int) -> str:
    """An object of the attachment: under the publish attempt's own data id, as every data object of the run."""
    return f"{EXACT_DIR}/{version:012d}-{data_id}-{part:05d}.ckd"


_ANY_KEY = re.compile(rf"^{EXACT_DIR}/(\d{{12}})(?:-[^/]+\.ckd|\.json)$")


def version_of_key(key: str) -> int | None:
    """The version an attachment's key (object or index) belongs to; None for another key."""
    m = _ANY_KEY.match(key)
    return None if m is None else int(m.group(1))


def widen(bf16_bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> the same values as fp32 (uint32 bits shifted up 16): exact for every pattern, NaN
    payloads and signs included, which a float conversion need not keep."""
    return (bf16_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


@dataclass(frozen=True)
class ExactEntry:
    """Where one tensor's record lies (an object of the attachment, a byte range), and the xxh3 of the exact
    bits it rebuilds; or, with ``dtype`` the one it is published in and nothing else, that it was published as
    it was (a bf16 tensor of the trainer's): the index names every BF16 tensor of the snapshot, so an entry
    lost from it is an error, not a tensor silently taken as exact."""

    dtype: str
    xxh3: str | None = None
    object: int | None = None
    offset: int | None = None
    length: int | None = None

    @property
    def has_record(self) -> bool:
        return self.object is not None


@dataclass(frozen=True)
class ExactIndex:
    """An attachment's index: the objects (parts) holding its records, and each tensor's record in them."""

    run_id: str
    version: int
    objects: tuple[ObjectRef, ...]
    tensors: dict[str, ExactEntry]

    def to_json(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "schema_version": SCHEMA_VERSION, "run_id": self.run_id, "version": self.version,
            "objects": [{"key": o.key, "size": o.size, "xxh3": o.xxh3} for o in self.objects],
            "tensors": {n: {"dtype": e.dtype, "xxh3": e.xxh3, "object": e.object, "offset": e.offset,
                            "length": e.length} if e.has_record else {"dtype": e.dtype}
                        for n, e in sorted(self.tensors.items())}},
            separators=(",", ":")).encode()


def parse_index(data: bytes, *, run_id: str, manifest: Manifest) -> ExactIndex:
    """An attachment's index read from storage, checked against the snapshot it belongs to before anything it
    says is fetched or allocated for: its run and version, objects of its own version, every tensor one of the
    snapshot's published in a dtype the format widens, each record inside its object, none overlapping, and
    no larger than its tensor's exact bits could need."""
    what = f"exact attachment {index_key(manifest.version)} of {manifest.where()}"
    d = untrusted_json.loads(data, what=what, max_bytes=MAX_INDEX_BYTES)

    def bad(why: str) -> FormatError:
        return FormatError(f"{what}: {why}")

    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} index")
    sv = d.get("schema_version")
    if type(sv) is not int or sv < 1:
        raise bad(f"schema_version {sv!r} is not a positive int")
    if sv > SCHEMA_VERSION:
        raise bad(f"schema_version {sv} was written by a newer ckptdelta (this one reads {SCHEMA_VERSION})")
    if set(d) != {"format", "schema_version", "run_id", "version", "objects", "tensors"}:
        raise bad(f"fields {sorted(d)} are not the format's")
    if d["run_id"] != run_id:
        raise RunMismatchError(f"{what}: it belongs to run {d['run_id']!r}, not {run_id!r}")
    if d["version"] != manifest.version or type(d["version"]) is not int:
        raise bad(f"it names version {d['version']!r}")
    os_ = d["objects"]
    if not isinstance(os_, list) or len(os_) > MAX_OBJECTS:
        raise bad(f"objects is not a list of at most {MAX_OBJECTS}")
    objects = []
    for o in os_:
        if not isinstance(o, dict) or set(o) != {"key", "size", "xxh3"}:
            raise bad("an object is not {key, size, xxh3}")
        key, size, xx = o["key"], o["size"], o["xxh3"]
        km = OBJECT_KEY.match(key) if isinstance(key, str) else None
        if km is None or int(km.group(1)) != manifest.version:
            raise bad(f"object key {key!r} is not one of this version's attachments")
        check_key(key, what=f"{what}: object key")
        if type(size) is not int or not 0 < size <= 1 << 48:
            raise bad(f"object {key}: size {size!r} is out of range")
        if not isinstance(xx, str) or _HEX16.match(xx) is None:
            raise bad(f"object {key}: xxh3 {xx!r} is not 16 hex digits")
        objects.append(ObjectRef(key, size, xx))
    if len({o.key for o in objects}) != len(objects):
        raise bad("an object is listed twice")
    ts = d["tensors"]
    if not isinstance(ts, dict):
        raise bad("tensors is not an object")
    entries: dict[str, ExactEntry] = {}
    for name, e in ts.items():
        m = manifest.tensors.get(name)
        if m is None:
            raise bad(f"tensor {name!r} is not in the snapshot")
        if m.dtype not in WIDENS:
            raise bad(f"tensor {name!r} is published as {m.dtype}, which no exact bits are kept for")
        if e == {"dtype": m.dtype}:           # published as it was
            entries[name] = ExactEntry(m.dtype)
            continue
        if not isinstance(e, dict) or set(e) != {"dtype", "xxh3", "object", "offset", "length"}:
            raise bad(f"tensor {name!r}: its entry is not {{dtype, xxh3, object, offset, length}}")
        if e["dtype"] != WIDENS[m.dtype]:
            raise bad(f"tensor {name!r}: exact dtype {e['dtype']!r}, the format keeps {WIDENS[m.dtype]} for "
                      f"{m.dtype}")
        if not isinstance(e["xxh3"], str) or _HEX16.match(e["xxh3"]) is None:
            raise bad(f"tensor {name!r}: xxh3 {e['xxh3']!r} is not 16 hex digits")
        i, off, n = e["object"], e["offset"], e["length"]
        if type(i) is not int or not 0 <= i < len(objects):
            raise bad(f"tensor {name!r}: object {i!r} is not one of the {len(objects)} listed")
        size = objects[i].size
        if type(off) is not int or type(n) is not int or off < 8 or n < 1 or off + n > size:
            raise bad(f"tensor {name!r}: record [{off!r}, +{n!r}) is not inside the {size}-byte object "
                      f"{objects[i].key}")
        numel = int(np.prod(m.shape, dtype=np.int64)) if m.shape else 1
        most = max_record_size(numel, 4, len(m.shape), len(name.encode()))
        if n > most:
            raise bad(f"tensor {name!r}: a {n}-byte record where one of its {numel} fp32 elements takes at most "
                      f"{most}")
        entries[name] = ExactEntry(e["dtype"], e["xxh3"], i, off, n)
    missing = sorted(n for n, m in manifest.tensors.items() if m.dtype in WIDENS and n not in entries)
    if missing:
        raise bad(f"{len(missing)} of the snapshot's {'/'.join(WIDENS)} tensors have no entry ({missing[0]!r} "
                  "first): the index names every one")
    spans = sorted((e.object, e.offset, e.offset + e.length, n) for n, e in entries.items() if e.has_record)
    for (o1, _, end, a), (o2, start, _, b) in zip(spans, spans[1:]):
        if o1 == o2 and start < end:   # records back to back, as a writer lays them: reading all reads each once
            raise bad(f"the records of tensors {a!r} and {b!r} overlap")
    return ExactIndex(run_id, manifest.version, tuple(objects), entries)
