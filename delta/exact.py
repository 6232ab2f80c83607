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
#: the dtype a tensor is published in -> the dtype its exact bits are kept in (the widening docs/FORMAT.md defines)
WIDENS = {"BF16": "F32"}
#: object key of an attachment: its version, then the publish attempt's data id
OBJECT_KEY = re.compile(rf"^{EXACT_DIR}/(\d{{12}})-[0-9a-zA-Z-]+\.ckd$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def index_key(version: int) -> str:
    """The attachment's index: written last, create-only (its presence says the attachment is whole)."""
    return f"{EXACT_DIR}/{version:012d}.json"


def object_key(version: int, data_id: str) -> str:
    return f"{EXACT_DIR}/{version:012d}-{data_id}.ckd"


def version_of_key(key: str) -> int | None:
    """The version an attachment's key (object or index) belongs to; None for another key."""
    m = re.match(rf"^{EXACT_DIR}/(\d{{12}})(?:-[^/]+\.ckd|\.json)$", key)
    return None if m is None else int(m.group(1))


def widen(bf16_bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> the same values as fp32 (uint32 bits shifted up 16): exact for every pattern, NaN
    payloads and signs included, which a float conversion need not keep."""
    return (bf16_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


@dataclass(frozen=True)
class ExactEntry:
    """Where one tensor's record lies in the attachment's object, and the xxh3 of the exact bits it rebuilds."""

    dtype: str
    xxh3: str
    offset: int
    length: int


@dataclass(frozen=True)
class ExactIndex:
    run_id: str
    version: int
    object: ObjectRef
    tensors: dict[str, ExactEntry]

    def to_json(self) -> bytes:
        import json
        return json.dumps({
            "format": FORMAT, "schema_version": SCHEMA_VERSION, "run_id": self.run_id, "version": self.version,
            "object": {"key": self.object.key, "size": self.object.size, "xxh3": self.object.xxh3},
            "tensors": {n: {"dtype": e.dtype, "xxh3": e.xxh3, "offset": e.offset, "length": e.length}
                        for n, e in sorted(self.tensors.items())}}, separators=(",", ":")).encode()


def parse_index(data: bytes, *, run_id: str, manifest: Manifest) -> ExactIndex:
    """An attachment's index read from storage, checked against the snapshot it belongs to before anything it
    says is fetched or allocated for: its run and version, a key of its own version, every tensor one of the
    snapshot's published in a dtype the format widens, each record inside the object and no larger than its
    tensor's exact bits could need."""
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
    if set(d) != {"format", "schema_version", "run_id", "version", "object", "tensors"}:
        raise bad(f"fields {sorted(d)} are not the format's")
    if d["run_id"] != run_id:
        raise RunMismatchError(f"{what}: it belongs to run {d['run_id']!r}, not {run_id!r}")
    if d["version"] != manifest.version or type(d["version"]) is not int:
        raise bad(f"it names version {d['version']!r}")
    o = d["object"]
    if not isinstance(o, dict) or set(o) != {"key", "size", "xxh3"}:
        raise bad("its object is not {key, size, xxh3}")
    key, size, xx = o["key"], o["size"], o["xxh3"]
    if not isinstance(key, str) or not key.startswith(f"{EXACT_DIR}/{manifest.version:012d}-") \
            or OBJECT_KEY.match(key) is None:
        raise bad(f"object key {key!r} is not one of this version's attachments")
    check_key(key, what=f"{what}: object key")
    if type(size) is not int or not 0 < size <= 1 << 48:
        raise bad(f"object size {size!r} is out of range")
    if not isinstance(xx, str) or _HEX16.match(xx) is None:
        raise bad(f"object xxh3 {xx!r} is not 16 hex digits")
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
        if not isinstance(e, dict) or set(e) != {"dtype", "xxh3", "offset", "length"}:
            raise bad(f"tensor {name!r}: its entry is not {{dtype, xxh3, offset, length}}")
        if e["dtype"] != WIDENS[m.dtype]:
            raise bad(f"tensor {name!r}: exact dtype {e['dtype']!r}, the format keeps {WIDENS[m.dtype]} for "
                      f"{m.dtype}")
        if not isinstance(e["xxh3"], str) or _HEX16.match(e["xxh3"]) is None:
            raise bad(f"tensor {name!r}: xxh3 {e['xxh3']!r} is not 16 hex digits")
        off, n = e["offset"], e["length"]
        if type(off) is not int or type(n) is not int or off < 8 or n < 1 or off + n > size:
            raise bad(f"tensor {name!r}: record [{off!r}, +{n!r}) is not inside the {size}-byte object")
        numel = int(np.prod(m.shape, dtype=np.int64)) if m.shape else 1
        most = max_record_size(numel, 4, len(m.shape), len(name.encode()))
        if n > most:
            raise bad(f"tensor {name!r}: a {n}-byte record where one of its {numel} fp32 elements takes at most "
                      f"{most}")
        entries[name] = ExactEntry(e["dtype"], e["xxh3"], off, n)
    return ExactIndex(run_id, manifest.version, ObjectRef(key, size, xx), entries)

