"""Snapshot manifests, the head pointer and the run's bucket layout (docs/FORMAT.md, "Runs").

Both sides share this module: publisher/ writes these objects, loader/ reads
them, and neither imports the other. Manifests are JSON (never pickle); every
field is validated on the way in — types, ranges, keys that stay inside the run,
offsets inside their objects — before any of it is used to fetch or allocate.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Iterable, Literal, overload

import numpy as np
import xxhash

from ckptdelta.delta import dtypes, untrusted_json
from ckptdelta.delta.lora_record import AdapterRecord
from ckptdelta.delta.errors import ManifestError, RunMismatchError
from ckptdelta.delta.pieces import MAX_PIECES, PIECES_MAGIC, PieceEntry, cells, grid_cuts, pieces_digest
from ckptdelta.delta.record import max_record_size

SCHEMA_VERSION = 1
#: The schema of a manifest that holds a pieced tensor (docs/FORMAT.md, "Pieces"); readers of version 1 refuse
#: it rather than take its pieced entries' null ``object`` for "unchanged".
PIECES_SCHEMA_VERSION = 2
SCHEMA_VERSIONS = (SCHEMA_VERSION, PIECES_SCHEMA_VERSION)
MANIFEST_FORMAT = "ckptdelta-manifest"
HEAD_FORMAT = "ckptdelta-head"
RUN_FORMAT = "ckptdelta-run"
MAX_MANIFEST_BYTES = 128 << 20
MAX_HEAD_BYTES = 64 << 10
MAX_TENSORS = 1 << 20
MAX_METADATA_BYTES = 1 << 20
#: The largest extra file (config, tokenizer, chat template) a snapshot may carry: a reader holds one whole in
#: memory, so a manifest may not make it allocate more (real tokenizers are tens of MB).
MAX_EXTRA_FILE_BYTES = 256 << 20
#: Extra files per snapshot.
MAX_EXTRA_FILES = 4096

RUN_KEY = "RUN.json"
HEAD_KEY = "HEAD"
MANIFEST_DIR = "manifests"
ANCHOR_DIR = "anchors"
DELTA_DIR = "deltas"

Kind = Literal["anchor", "delta"]

_KEY_RE = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")
_NAME_RE = re.compile(r"^v(\d{8,})$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


# --- layout ------------------------------------------------------------------

def snapshot_name(version: int) -> str:
    return f"v{version:08d}"


def parse_snapshot_name(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def manifest_key(version: int) -> str:
    return f"{MANIFEST_DIR}/{version:012d}.json"


def version_of_manifest_key(key: str) -> int | None:
    m = re.fullmatch(rf"{MANIFEST_DIR}/(\d{{12}})\.json", key)
    return int(m.group(1)) if m else None


def anchor_prefix(version: int, writer_id: str) -> str:
    return f"{ANCHOR_DIR}/{version:012d}-{writer_id}"


def delta_prefix(version: int, writer_id: str) -> str:
    return f"{DELTA_DIR}/{version:012d}-{writer_id}"


#: Tensor names the format gives another meaning: a safetensors header's own metadata entry.
RESERVED_TENSOR_NAMES = frozenset({"__metadata__"})
#: A tensor name's longest UTF-8 form (a record header's name field, docs/FORMAT.md).
MAX_TENSOR_NAME_BYTES = 4096


def tensor_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a tensor in a snapshot, or None. Shared by the manifest parser and the
    publisher, which refuses such a tensor before writing anything (it would commit what readers refuse)."""
    if not isinstance(name, str) or not name:
        return "tensor names must be non-empty strings"
    if name in RESERVED_TENSOR_NAMES:
        return f"the name {name!r} is reserved by the safetensors format (a shard header's metadata entry)"
    nb = _utf8(name)
    if nb is None:
        return "the name is not valid UTF-8"
    if len(nb) > MAX_TENSOR_NAME_BYTES:
        return f"the name is {len(nb)} bytes in UTF-8 (at most {MAX_TENSOR_NAME_BYTES})"
    return None


#: A key's longest form, and its longest segment: S3's limit on a key, and the longest file name most
#: filesystems take (NAME_MAX), so a reader can write any extra file of a snapshot to a local directory.
MAX_KEY_BYTES = 1024
MAX_KEY_SEGMENT_BYTES = 255


def is_safe_key(key: str) -> bool:
    """A relative key of at most ``MAX_KEY_BYTES`` with no empty, '.' or '..' segment and none longer than
    ``MAX_KEY_SEGMENT_BYTES``: it cannot leave the run, and each of its segments can name a local file."""
    if len(key) > MAX_KEY_BYTES or not _KEY_RE.match(key):
        return False
    return not any(p in (".", "..") or len(p) > MAX_KEY_SEGMENT_BYTES for p in key.split("/"))


def extra_file_name(key: str) -> str:
    """Where an extra file goes in the snapshot's model directory: its key below the version's prefix
    (``anchors/<v>-<writer>/tok/vocab.json`` -> ``tok/vocab.json``), else its last segment."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] in (ANCHOR_DIR, DELTA_DIR):
        return "/".join(parts[2:])
    return parts[-1]


def extra_names_clash(names: Iterable[str]) -> tuple[str, str] | None:
    """Two of these extra-file names that cannot both be files of one directory, or None: the same name twice,
    or a file that is also the directory of another ('a' and 'a/b'). Shared by the manifest parser and the
    publisher, which refuses such files before writing anything (readers would refuse the snapshot)."""
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n, n
        seen.add(n)
    for n in sorted(seen):
        parts = n.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in seen:
                return parent, n
    return None


def clash_text(clash: tuple[str, str]) -> str:
    """What :func:`extra_names_clash` found, in words."""
    a, b = clash
    return f"{a!r} is named twice" if a == b else f"{a!r} is both a file and the directory of {b!r}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- records -------------------------------------------------------------------

@dataclass(frozen=True)
class ObjectRef:
    """One stored object a snapshot needs."""

    key: str      # relative to the run root
    size: int     # bytes
    xxh3: str     # xxh3-64 of the whole object, 16 hex digits


class PieceColumns(Sequence[PieceEntry]):
    """A pieced entry's pieces as the format stores them (docs/FORMAT.md, "Pieces"): the grid's ``cuts`` and one
    column per field, a value per cell in C order (``object`` None: the cell is unchanged); the xxh3s as one
    string, ``hexes``, 16 hex digits a piece.

    A sharded 1T model's delta lists ~470,000 pieces, 256 per tensor. Parsed and checked (array operations over
    the columns of every entry at once), merged on rank 0 and written back as these columns, no piece becomes a
    Python object of its own on the way: one object per piece, made and checked one by one, was most of rank
    0's metadata time per publish at 256 ranks, and a cost per piece on each replica (docs/PERFORMANCE.md,
    "Rank 0's metadata at scale"). Whoever looks at the
    pieces one by one (a reader staging them) gets each as a :class:`PieceEntry`, all made once when first
    asked for; the columns compare equal to the tuple of those entries. The columns are kept as given (the
    parser's lists, rank 0's slices), not copied."""

    __slots__ = ("cuts", "hexes", "object", "offset", "length", "_entries")

    def __init__(self, cuts: Sequence[Sequence[int]], xxh3: str | Sequence[str],
                 object: Sequence[int | None], offset: Sequence[int], length: Sequence[int]) -> None:  # noqa: A002
        self.cuts: tuple[tuple[int, ...], ...] = tuple(tuple(c) for c in cuts)
        self.hexes: str = xxh3 if isinstance(xxh3, str) else "".join(xxh3)
        self.object, self.offset, self.length = _column(object), _column(offset), _column(length)
        self._entries: tuple[PieceEntry, ...] | None = None
        n = math.prod(len(c) - 1 for c in self.cuts)
        if not (self.cuts and len(self.hexes) == 16 * n and len(self.object) == len(self.offset) == len(self.length)
                == n):
            raise ValueError(f"pieces: a grid of {n} cells with {len(self.hexes)} hex digits of xxh3s and columns "
                             f"of {len(self.object)}, {len(self.offset)} and {len(self.length)} values")

    @property
    def xxh3(self) -> list[str]:
        """Each piece's xxh3."""
        return _SIXTEEN.findall(self.hexes)

    def entries(self) -> tuple[PieceEntry, ...]:
        """The pieces one by one (made on the first call, then kept)."""
        if self._entries is None:
            self._entries = tuple(PieceEntry(o, s, h, ob, off, ln) for (o, s), h, ob, off, ln in
                                  zip(cells(self.cuts), self.xxh3, self.object, self.offset, self.length))
        return self._entries

    @property
    def has_data(self) -> bool:
        """Whether some piece has a record (is not unchanged)."""
        return self.object.count(None) != len(self.object)

    def __len__(self) -> int:
        return len(self.object)

    @overload
    def __getitem__(self, k: int) -> PieceEntry: ...

    @overload
    def __getitem__(self, k: slice) -> tuple[PieceEntry, ...]: ...

    def __getitem__(self, k: int | slice) -> PieceEntry | tuple[PieceEntry, ...]:
        return self.entries()[k]

    def __iter__(self) -> Any:
        return iter(self.entries())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PieceColumns):
            return self.cuts == other.cuts and self.hexes == other.hexes and all(
                tuple(a) == tuple(b) for a, b in ((self.object, other.object), (self.offset, other.offset),
                                                  (self.length, other.length)))
        if isinstance(other, (tuple, list)):
            return self.entries() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.entries())     # as the tuple it equals

    def __repr__(self) -> str:
        return f"PieceColumns({len(self)} pieces, cuts {[len(c) - 1 for c in self.cuts]})"

    def __reduce__(self) -> tuple:
        return PieceColumns, (self.cuts, self.hexes, self.object, self.offset, self.length)


_SIXTEEN = re.compile(".{16}", re.DOTALL)


def _column(values: Sequence[Any]) -> Sequence[Any]:
    return values if isinstance(values, (list, tuple)) else tuple(values)


@dataclass(frozen=True)
class GridCells:
    """The cells of several grids of one ndim as rows of arrays: grid ``which[g]``'s cells are rows
    ``start[g]:start[g + 1]`` (in C order), and row i is row ``rows[i]`` of a column holding every grid's
    cells, the grids in the order given."""

    which: list[int]
    start: np.ndarray
    rows: np.ndarray
    offsets: np.ndarray     # (cells, ndim) int64
    shape: np.ndarray


def grid_cells(grids: Sequence[Sequence[Sequence[int]]]) -> tuple[np.ndarray, list[GridCells]]:
    """Every cell of every grid (per grid, per dimension its cuts) at once, grouped by ndim: the offsets and
    shape of each, what :func:`ckptdelta.delta.pieces.cells` lists for one grid, made with a few array operations for
    all of them (no tuple per cell). Also returns where each grid's cells start in the whole column."""
    counts = [math.prod(len(c) - 1 for c in g) for g in grids]
    first = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    by_ndim: dict[int, list[int]] = {}
    for i, g in enumerate(grids):
        by_ndim.setdefault(len(g), []).append(i)
    out = []
    for ndim, which in by_ndim.items():
        n = np.array([[len(c) - 1 for c in grids[i]] for i in which], np.int64).reshape(len(which), ndim)
        count = n.prod(axis=1)
        start = np.concatenate(([0], np.cumsum(count)))
        grid = np.repeat(np.arange(len(which)), count)
        k = np.arange(int(start[-1])) - start[grid]             # each cell's index in its grid
        offsets = np.empty((len(k), ndim), np.int64)
        shape = np.empty_like(offsets)
        stride = np.ones(len(which), np.int64)
        for d in reversed(range(ndim)):                        # C order: the last dimension varies fastest
            edges = np.fromiter(itertools.chain.from_iterable(grids[i][d] for i in which), np.int64)
            base = np.concatenate(([0], np.cumsum(n[:, d] + 1)))[:-1]
            at = base[grid] + (k // stride[grid]) % n[grid, d]
            offsets[:, d] = edges[at]
            shape[:, d] = edges[at + 1] - edges[at]
            stride *= n[:, d]
        out.append(GridCells(which, start, first[which][grid] + k, offsets, shape))
    return first, out


def pieces_digests(grids: Sequence[Sequence[Sequence[int]]], xxh3: np.ndarray,
                   cells: tuple[np.ndarray, list[GridCells]] | None = None) -> list[str]:
    """The digests of pieced tensors whose pieces are the cells of ``grids`` with these xxh3s (uint64, every
    grid's cells in order, one after the other): :func:`ckptdelta.delta.pieces.pieces_digest`'s bytes (docs/FORMAT.md,
    "Pieces") made as one array per ndim, each tensor's hashed from its rows. ``cells``: what
    :func:`grid_cells` gave for ``grids``, if at hand."""
    out = [""] * len(grids)
    head = struct.Struct("<II")
    for c in (cells or grid_cells(grids))[1]:
        ndim = c.offsets.shape[1]
        table = np.empty((len(c.rows), 2 * ndim + 1), "<u8")
        table[:, :ndim] = c.offsets
        table[:, ndim:2 * ndim] = c.shape
        table[:, -1] = xxh3[c.rows]
        data = memoryview(table).cast("B")
        width = 8 * (2 * ndim + 1)
        for i, a, b in zip(c.which, c.start[:-1].tolist(), c.start[1:].tolist()):
            h = xxhash.xxh3_64(PIECES_MAGIC + head.pack(ndim, b - a))
            h.update(data[a * width: b * width])
            out[i] = f"{h.intdigest():016x}"
    return out


def hex_digests(xxh3: np.ndarray) -> str:
    """uint64 digests as the format writes them, 16 lowercase hex digits each, one after the other in one
    string (:attr:`PieceColumns.hexes`)."""
    return np.ascontiguousarray(xxh3, ">u8").tobytes().hex()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are and what they must hash to.

    In an anchor, ``offset``/``length`` is the tensor's data inside its safetensors
    shard (absolute in the file); in a delta, its record inside the delta object.
    ``object`` is None when the tensor is bit-identical to the parent version's:
    it then costs only this entry. A delta's tensor published by several ranks lists
    ``pieces`` instead (delta/pieces.py): ``object`` is then None, and ``xxh3`` is the
    digest of its pieces' digests."""

    dtype: str
    shape: tuple[int, ...]
    xxh3: str
    object: int | None
    offset: int = 0
    length: int = 0
    pieces: Sequence[PieceEntry] = ()       # a tuple, or (parsed, or merged on rank 0) their PieceColumns

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def has_data(self) -> bool:
        """Whether this snapshot stores bytes for the tensor (its data, a record, or a record of a piece)."""
        if isinstance(self.pieces, PieceColumns):
            return self.object is not None or self.pieces.has_data
        return self.object is not None or any(p.object is not None for p in self.pieces)

    @property
    def grid(self) -> tuple[tuple[int, ...], ...]:
        """A pieced entry's grid: per dimension, the edges its pieces cut it at (docs/FORMAT.md, "Pieces"); the
        pieces are that grid's cells, so two entries have the same boxes exactly when their grids are equal.
        () for a whole entry."""
        if not self.pieces:
            return ()
        if isinstance(self.pieces, PieceColumns):
            return self.pieces.cuts
        return tuple(tuple(c) for c in grid_cuts(self.shape, [p.box for p in self.pieces]))

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.by_name(self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    run_id: str
    version: int
    kind: Kind
    parent_version: int | None
    anchor_version: int
    created: str
    step: int | None
    writer_id: str
    objects: tuple[ObjectRef, ...]
    tensors: dict[str, TensorEntry]
    extra_files: tuple[ObjectRef, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    full_bytes: int = 0
    stored_bytes: int = 0
    adapter: AdapterRecord | None = None   # a LoRA run's base and adapter config (delta/lora_record.py); None otherwise

    @property
    def name(self) -> str:
        return snapshot_name(self.version)

    def where(self) -> str:
        return f"snapshot {self.name} (version {self.version}) of run {self.run_id}"

    def to_json(self) -> bytes:
        # Field by field (dataclasses.asdict deep-copies every entry: seconds for the 10^5 pieces of a sharded
        # 70B model's manifest); the keys in the dataclass's order, as before.
        pieced = any(e.pieces for e in self.tensors.values())
        d: dict[str, Any] = {"format": MANIFEST_FORMAT,
                             "schema_version": PIECES_SCHEMA_VERSION if pieced else SCHEMA_VERSION,
                             "name": self.name}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("objects", "extra_files"):
                v = [{"key": o.key, "size": o.size, "xxh3": o.xxh3} for o in v]
            elif f.name == "tensors":
                if pieced:      # written by hand below: a pieced entry's xxh3s are one string, not a list of them
                    continue
                v = {k: _entry_json(e) for k, e in v.items()}
            elif f.name == "metadata":
                v = dict(v)
            elif f.name == "adapter":
                if v is None:       # a full-model run's manifest has no adapter field at all
                    continue
                v = asdict(v)
            d[f.name] = v
        if not pieced:
            return json.dumps(d, separators=(",", ":"), sort_keys=False).encode()
        # What json.dumps writes for the same dict, made of its values' encodings (JSON's text of an object is
        # its members' texts joined): the tensors between writer_id and objects, as they are in the dataclass.
        enc = _ENCODER.encode
        members = [f"{enc(k)}:{enc(v)}" for k, v in d.items()]
        members.insert(list(d).index("objects") + 1, f'"tensors":{_tensors_json(self.tensors)}')
        return ("{" + ",".join(members) + "}").encode()

    @classmethod
    def from_json(cls, data: bytes, *, what: str = "manifest", run_id: str | None = None) -> "Manifest":
        d = _load_json(data, what, MAX_MANIFEST_BYTES)
        _expect(d.get("format") == MANIFEST_FORMAT, what, f"format is {d.get('format')!r}, not {MANIFEST_FORMAT!r}")
        schema = d.get("schema_version")
        _expect(type(schema) is int and schema in SCHEMA_VERSIONS, what,
                f"schema_version {schema!r} is not supported (this reader knows "
                f"{', '.join(map(str, SCHEMA_VERSIONS))})")
        version = _int(d, "version", what)
        what = f"{what} (version {version})"
        kind = d.get("kind")
        _expect(kind in ("anchor", "delta"), what, f"kind {kind!r}")
        parent = d.get("parent_version")
        if parent is not None:
            _expect(type(parent) is int and 0 <= parent < version, what, f"parent_version {parent!r}")
        _expect(kind == "anchor" or parent is not None, what, "a delta without parent_version")
        anchor = _int(d, "anchor_version", what)
        _expect(anchor <= version and (kind != "anchor" or anchor == version), what, f"anchor_version {anchor}")
        _expect(d.get("name") == snapshot_name(version), what, f"name {d.get('name')!r} does not match the version")
        rid = _str(d, "run_id", what)
        if run_id is not None and rid != run_id:
            raise RunMismatchError(f"{what}: belongs to run {rid!r}, expected run {run_id!r}")
        step = d.get("step")
        _expect(step is None or (isinstance(step, int) and not isinstance(step, bool)), what, f"step {step!r}")
        objects = tuple(_object(o, what) for o in _list(d, "objects", what))
        extra = tuple(_object(o, what) for o in _list(d, "extra_files", what))
        _expect(len(extra) <= MAX_EXTRA_FILES, what, f"{len(extra)} extra files (at most {MAX_EXTRA_FILES})")
        for o in extra:
            _expect(o.size <= MAX_EXTRA_FILE_BYTES, what,
                    f"extra file {o.key!r} of {o.size} bytes (at most {MAX_EXTRA_FILE_BYTES})")
        clash = extra_names_clash(extra_file_name(o.key) for o in extra)
        if clash is not None:
            keys = [o.key for o in extra if extra_file_name(o.key) in clash]
            _expect(False, what, f"extra files: {clash_text(clash)} ({', '.join(map(repr, keys[:4]))}): they "
                                 "cannot be written into one model directory")
        raw_tensors = d.get("tensors")
        _expect(isinstance(raw_tensors, dict) and len(raw_tensors) <= MAX_TENSORS, what, "tensors must be a mapping")
        tensors = {}
        pieced: list[_Pieced] = []      # entries whose pieces' columns are checked together, after the loop
        try:
            for name, t in raw_tensors.items():
                tensors[name] = _tensor(name, t, objects, kind, what, pieced)
        except ManifestError:
            _check_pieces(pieced, objects)      # a failure of an earlier entry's pieces is the one to report
            raise
        _check_pieces(pieced, objects)
        pieced = any(e.pieces for e in tensors.values())
        _expect(pieced == (schema == PIECES_SCHEMA_VERSION), what,
                f"schema_version {schema} with{'' if pieced else 'out'} pieced tensors (2 exactly when some are)")
        metadata = d.get("metadata", {})
        problem = metadata_problem(metadata)
        _expect(problem is None, what, problem or "")
        return cls(
            run_id=rid, version=version, kind=kind, parent_version=parent, anchor_version=anchor,
            created=_str(d, "created", what), step=step, writer_id=_str(d, "writer_id", what),
            objects=objects, tensors=tensors, extra_files=extra, metadata=dict(metadata),
            full_bytes=_int(d, "full_bytes", what), stored_bytes=_int(d, "stored_bytes", what),
            adapter=None if d.get("adapter") is None else AdapterRecord.from_dict(d["adapter"], what),
        )


@dataclass(frozen=True)
class Head:
    """The head pointer: a hint naming the newest committed snapshot.

    Manifests are the truth (a crash between the manifest and the head leaves the
    head one behind); readers that need "latest" also look past the head."""

    run_id: str
    version: int
    manifest_xxh3: str

    def to_json(self) -> bytes:
        return json.dumps({"format": HEAD_FORMAT, "schema_version": SCHEMA_VERSION, "name": snapshot_name(self.version),
                           **asdict(self)}).encode()

    @classmethod
    def from_json(cls, data: bytes, *, what: str = "head pointer") -> "Head":
        d = _load_json(data, what, MAX_HEAD_BYTES)
        _expect(d.get("format") == HEAD_FORMAT and d.get("schema_version") == SCHEMA_VERSION, what, "unknown format")
        h = d.get("manifest_xxh3")
        _expect(isinstance(h, str) and bool(_HEX16.match(h)), what, "manifest_xxh3")
        return cls(_str(d, "run_id", what), _int(d, "version", what), h)


@dataclass(frozen=True)
class RunInfo:
    """RUN.json: written once, create-only, by the run's first publisher."""

    run_id: str
    created: str

    def to_json(self) -> bytes:
        return json.dumps({"format": RUN_FORMAT, "schema_version": SCHEMA_VERSION, **asdict(self)}).encode()

    @classmethod
    def from_json(cls, data: bytes, *, what: str = "RUN.json") -> "RunInfo":
        d = _load_json(data, what, MAX_HEAD_BYTES)
        _expect(d.get("format") == RUN_FORMAT, what, "unknown format")
        return cls(_str(d, "run_id", what), _str(d, "created", what))


# --- validation helpers ----------------------------------------------------------

def _load_json(data: bytes, what: str, max_bytes: int) -> dict[str, Any]:
    d = untrusted_json.loads(data, what=what, max_bytes=max_bytes, error=ManifestError)
    _expect(isinstance(d, dict), what, "top level must be an object")
    return d


def _expect(ok: bool, what: str, msg: str) -> None:
    if not ok:
        if len(msg) > 1000:     # a hostile value's repr: the message stays one readable line
            msg = msg[:1000] + "..."
        raise ManifestError(f"{what}: invalid {msg}")


def _int(d: dict, k: str, what: str) -> int:
    v = d.get(k)
    _expect(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62, what, f"{k} {v!r}")
    return v


def _str(d: dict, k: str, what: str) -> str:
    v = d.get(k)
    _expect(isinstance(v, str) and 0 < len(v) <= 256 and _utf8(v) is not None, what, f"{k} {v!r}")
    return v


def text_problem(v: Any) -> str | None:
    """Why ``v`` cannot be a manifest's name-like string (run_id, writer_id: 1-256 characters of valid UTF-8),
    or None. A publisher checks its inputs by the very rule its readers apply."""
    if not isinstance(v, str) or not 0 < len(v) <= 256:
        return "must be a non-empty string of at most 256 characters"
    if _utf8(v) is None:
        return "must be valid UTF-8 text (it holds a lone surrogate)"
    return None


def metadata_problem(metadata: Any) -> str | None:
    """Why ``metadata`` cannot be a manifest's user metadata (strings to strings, at most
    :data:`MAX_METADATA_BYTES` as JSON), or None."""
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        return "metadata must map strings to strings"
    size = len(json.dumps(metadata))
    if size > MAX_METADATA_BYTES:
        return f"metadata is {size} bytes as JSON, over the limit of {MAX_METADATA_BYTES}"
    return None


def _utf8(v: Any) -> bytes | None:
    """UTF-8 bytes of a JSON string, or None (not a string, or a lone surrogate from a \\udXXX escape)."""
    try:
        return v.encode("utf-8") if isinstance(v, str) else None
    except UnicodeEncodeError:
        return None


def _list(d: dict, k: str, what: str) -> list:
    v = d.get(k, [])
    _expect(isinstance(v, list) and len(v) <= MAX_TENSORS, what, f"{k}")
    return v


def _object(o: Any, what: str) -> ObjectRef:
    _expect(isinstance(o, dict), what, "object entry")
    key = o.get("key")
    _expect(isinstance(key, str) and is_safe_key(key), what, f"object key {key!r} (must stay inside the run)")
    h = o.get("xxh3")
    _expect(isinstance(h, str) and bool(_HEX16.match(h)), what, f"xxh3 of object {key!r}")
    return ObjectRef(key, _int(o, "size", what), h)


def _tensor(name: str, t: Any, objects: tuple[ObjectRef, ...], kind: str, what: str,
            pieced: list["_Pieced"]) -> TensorEntry:
    """One tensor entry, checked; a pieced one's structure only, its pieces' columns and digest being added to
    ``pieced`` for :func:`_check_pieces`."""
    where = f"{what} tensor {name!r}"
    _expect(tensor_name_problem(name) is None, what, f"tensor name {name!r}")
    nb = _utf8(name)
    _expect(isinstance(t, dict), where, "entry")
    dt = t.get("dtype")
    _expect(isinstance(dt, str) and dt in dtypes.BY_NAME, where, f"dtype {dt!r}")
    shape = t.get("shape")
    _expect(isinstance(shape, list) and len(shape) <= 32
            and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 48 for s in shape), where, "shape")
    _expect(math.prod(shape) <= 1 << 48, where, "shape (too many elements)")
    h = t.get("xxh3")
    _expect(isinstance(h, str) and bool(_HEX16.match(h)), where, "xxh3")
    obj = t.get("object")
    off, length = _int(t, "offset", where), _int(t, "length", where)
    if "pieces" in t:
        _expect(kind == "delta" and obj is None and off == 0 and length == 0, where,
                "pieces: only a delta's entry has them, with object null, offset and length 0")
        pieces = _pieces(t["pieces"], shape, where)
        pieced.append(_Pieced(where, h, dt, len(nb), pieces))
        return TensorEntry(dt, tuple(shape), h, None, 0, 0, pieces)
    if obj is None:
        _expect(kind == "delta" and off == 0 and length == 0, where, "unchanged entry outside a delta")
    else:
        _expect(type(obj) is int and 0 <= obj < len(objects), where, f"object index {obj!r}")
        _expect(off + length <= objects[obj].size, where, "byte range beyond its object")
        itemsize = dtypes.by_name(dt).itemsize
        if kind == "anchor":
            nbytes = math.prod(shape) * itemsize
            _expect(length == nbytes, where, f"length {length} for {nbytes} bytes of data")
        else:
            most = max_record_size(math.prod(shape), itemsize, len(shape), len(nb))
            _expect(length <= most, where, f"record length {length} (a record of {dt}{shape} takes at most {most})")
    return TensorEntry(dt, tuple(shape), h, obj, off, length)


_PIECES_KEYS = {"cuts", "xxh3", "object", "offset", "length"}
_HEX_RUN = re.compile(r"[0-9a-f]*")


def _pieces(raw: Any, shape: list[int], where: str) -> PieceColumns:
    """A pieced entry's pieces (docs/FORMAT.md, "Pieces"): the cells of a grid, their columns of fields; the
    keys, the grid and each column's length checked here, the columns' values by :func:`_check_pieces`."""
    if not (isinstance(raw, dict) and set(raw) == _PIECES_KEYS):
        _expect(False, where, f"pieces (an object with keys {sorted(_PIECES_KEYS)})")
    ndim = len(shape)
    cuts = raw["cuts"]
    if not (ndim >= 1 and isinstance(cuts, list) and len(cuts) == ndim):
        _expect(False, where, f"pieces cuts (a list of {ndim} lists; a scalar has no pieces)")
    n = 1
    for d, c in enumerate(cuts):
        if not (isinstance(c, list) and 2 <= len(c) <= MAX_PIECES + 1 and set(map(type, c)) == {int}
                and c[0] == 0 and c[-1] == shape[d] and all(map(operator.lt, c, c[1:]))):
            _expect(False, where,
                    f"pieces cuts of dimension {d} (ascending ints from 0 to {shape[d]}, at most {MAX_PIECES + 1})")
        n *= len(c) - 1
        if n > MAX_PIECES:
            _expect(False, where, f"pieces: more than {MAX_PIECES}")
    _expect(n >= 2, where, "pieces: 1 cell (a tensor in one piece is a plain entry)")
    cols = {k: raw[k] for k in ("xxh3", "object", "offset", "length")}
    for k, v in cols.items():
        if not (isinstance(v, list) and len(v) == n):
            _expect(False, where, f"pieces {k} (a list of {n} values, one per cell)")
    xs = cols["xxh3"]
    if not (set(map(type, xs)) == {str} and set(map(len, xs)) == {16}):    # hex digits: :func:`_check_pieces`
        _expect(False, where, "pieces xxh3 (16 lowercase hex digits each)")
    return PieceColumns(cuts, xs, cols["object"], cols["offset"], cols["length"])


@dataclass(frozen=True)
class _Pieced:
    """A pieced entry whose pieces' values are still to be checked (:func:`_check_pieces`)."""

    where: str
    xxh3: str               # the entry's: the digest of its pieces
    dtype: str
    name_len: int           # of the tensor's name in UTF-8 (a record's header holds it)
    pieces: PieceColumns


def _check_pieces(pieced: list[_Pieced], objects: tuple[ObjectRef, ...]) -> None:
    """Every piece of these entries: its xxh3 (16 lowercase hex digits), its byte range (none for an
    unchanged piece, inside its object otherwise), its record's length within the bound of a record of its
    box, and each entry's digest of its pieces. Decided over every piece of the manifest at once
    (:func:`_pieces_pass`); where that finds anything wrong, or cannot tell, the entries go through the same
    checks one by one, in order (:func:`_check_one_by_one`), which name the first entry and piece that
    fails."""
    if pieced and not _pieces_pass(pieced, objects):
        for p in pieced:
            _check_one_by_one(p, objects)


def _pieces_pass(pieced: list[_Pieced], objects: tuple[ObjectRef, ...]) -> bool:
    """Whether every piece passes :func:`_check_one_by_one`, decided with array operations over the columns
    of all the entries; False also where a column holds what arrays cannot take (ints past 64 bits)."""
    chain = itertools.chain.from_iterable
    hexes = "".join(p.pieces.hexes for p in pieced)
    if _HEX_RUN.fullmatch(hexes) is None:
        return False
    offs, lens, objs = ([getattr(p.pieces, k) for p in pieced] for k in ("offset", "length", "object"))
    if not (set(map(type, chain(offs))) == {int} and set(map(type, chain(lens))) == {int}
            and set(map(type, chain(objs))) <= {int, type(None)}):
        return False
    n = len(hexes) // 16
    try:
        off = np.fromiter(chain(offs), np.int64, n)
        length = np.fromiter(chain(lens), np.int64, n)
        obj = np.array(list(chain(objs)), np.float64)    # null -> NaN; exact for any index a valid entry has
    except OverflowError:
        return False
    both = off | length         # negative, or 2 ** 62 or more, where either is
    if both.min() < 0 or both.max() >= 1 << 62:
        return False
    unchanged = np.isnan(obj)
    if (both[unchanged] != 0).any():
        return False
    stored = ~unchanged
    index = obj[stored]
    if ((index < 0) | (index >= len(objects))).any():
        return False
    sizes = np.array([o.size for o in objects] or [0], np.int64)
    if (off[stored] + length[stored] > sizes[index.astype(np.int64)]).any():
        return False
    grids = [p.pieces.cuts for p in pieced]
    cells = grid_cells(grids)
    first, groups = cells
    numel = np.empty(n, np.int64)
    for c in groups:
        numel[c.rows] = c.shape.prod(axis=1)
    # each record's bound, worked out once per entry (most of an entry's cells have its first cell's size) and
    # for each cell of another size
    entry = np.repeat(np.arange(len(pieced)), np.diff(first))
    usual = numel[first[:-1]]
    most = np.array([max_record_size(int(x), dtypes.by_name(p.dtype).itemsize, len(p.pieces.cuts), p.name_len)
                     for x, p in zip(usual, pieced)], np.int64)[entry]
    other = np.flatnonzero(stored & (numel != usual[entry]))
    for k, e in zip(other.tolist(), entry[other].tolist()):
        p = pieced[e]
        most[k] = max_record_size(int(numel[k]), dtypes.by_name(p.dtype).itemsize, len(p.pieces.cuts), p.name_len)
    if (length[stored] > most[stored]).any():
        return False
    xxh3 = np.frombuffer(bytes.fromhex(hexes), ">u8")
    return pieces_digests(grids, xxh3, cells) == [p.xxh3 for p in pieced]


def _check_one_by_one(p: _Pieced, objects: tuple[ObjectRef, ...]) -> None:
    """One entry's pieces, one piece at a time, then its digest: raises naming the first that fails."""
    where, cols = p.where, p.pieces
    xs = cols.xxh3
    _expect(all(type(h) is str and len(h) == 16 for h in xs) and _HEX_RUN.fullmatch("".join(xs)) is not None,
            where, "pieces xxh3 (16 lowercase hex digits each)")
    ndim = len(cols.cuts)
    dt = p.dtype
    itemsize = dtypes.by_name(dt).itemsize
    for k, (box, obj, off, length) in enumerate(zip(cells(cols.cuts), cols.object, cols.offset, cols.length)):
        # each message is formatted only for a piece that fails its check
        if not (type(off) is int and type(length) is int and 0 <= off < 1 << 62 and 0 <= length < 1 << 62):
            _expect(False, where, f"piece {k}: offset / length")
        if obj is None:
            if not (off == 0 and length == 0):
                _expect(False, where, f"piece {k}: an unchanged piece with a byte range")
        else:
            if not (type(obj) is int and 0 <= obj < len(objects)):
                _expect(False, where, f"piece {k}: object index {obj!r}")
            if not off + length <= objects[obj].size:
                _expect(False, where, f"piece {k}: byte range beyond its object")
            most = max_record_size(math.prod(box[1]), itemsize, ndim, p.name_len)
            if not length <= most:
                _expect(False, where, f"piece {k}: record length {length} (a record of {dt}{list(box[1])} "
                                      f"takes at most {most})")
    digest = pieces_digest(cols.entries())
    _expect(p.xxh3 == digest, where, f"xxh3 {p.xxh3}: not the digest of its pieces ({digest})")


_ENCODER = json.JSONEncoder(separators=(",", ":"))
_LOWER_HEX = re.compile("[0-9a-f]*")


def _tensors_json(tensors: dict[str, TensorEntry]) -> str:
    """The manifest's ``tensors`` object as json.dumps writes it (the same text), a pieced entry's xxh3s
    written as a list of strings straight from its ``hexes`` (lowercase hex digits, which JSON writes as
    they are) with array operations over every entry's at once, not a string each."""
    enc = _ENCODER.encode
    cols = {n: e.pieces for n, e in tensors.items() if isinstance(e.pieces, PieceColumns)}
    hexes = "".join(p.hexes for p in cols.values())
    lists: dict[str, str] = {}
    if _LOWER_HEX.fullmatch(hexes) is not None:
        n = len(hexes) // 16
        quoted = np.empty((n, 19), np.uint8)        # "0123456789abcdef", per piece
        quoted[:, 0] = quoted[:, 17] = ord('"')
        quoted[:, 18] = ord(",")
        quoted[:, 1:17] = np.frombuffer(hexes.encode("ascii"), np.uint8).reshape(n, 16)
        text = quoted.tobytes().decode("ascii")
        at = 0
        for name, p in cols.items():
            k = len(p.hexes) // 16
            lists[name] = "[" + text[19 * at: 19 * (at + k) - 1] + "]"
            at += k
    out = []
    for name, e in tensors.items():
        if name not in cols:
            out.append(f"{enc(name)}:{enc(_entry_json(e))}")
            continue
        # the entry as json.dumps writes it with a stand-in for the pieces' xxh3 list, then the list in its place
        # (the stand-in is the entry's only string holding a NUL: dtype and digests are names and hex digits)
        p = e.pieces
        text = enc({"dtype": e.dtype, "shape": e.shape, "xxh3": e.xxh3, "object": e.object, "offset": e.offset,
                    "length": e.length, "pieces": {"cuts": p.cuts, "xxh3": _STAND_IN, "object": p.object,
                                                   "offset": p.offset, "length": p.length}})
        xxh3 = lists.get(name)
        if xxh3 is None or text.count(_STAND_IN_JSON) != 1:
            text = enc(_entry_json(e))
        else:
            text = text.replace(_STAND_IN_JSON, xxh3)
        out.append(f"{enc(name)}:{text}")
    return "{" + ",".join(out) + "}"


_STAND_IN = "\0pieces' xxh3\0"
_STAND_IN_JSON = json.dumps(_STAND_IN)


def _entry_json(e: TensorEntry) -> dict:
    """A tensor entry as the manifest writes it: a plain entry has no ``pieces`` key at all; a pieced one's are
    the grid's cuts and a column per field, a value per cell (compact: ~40 bytes a piece)."""
    out = {"dtype": e.dtype, "shape": list(e.shape), "xxh3": e.xxh3, "object": e.object, "offset": e.offset,
           "length": e.length}
    if isinstance(e.pieces, PieceColumns):      # the grid's cells by construction: the columns as they are
        ps = e.pieces
        out["pieces"] = {"cuts": ps.cuts, "xxh3": ps.xxh3, "object": ps.object, "offset": ps.offset,
                         "length": ps.length}
    elif e.pieces:
        ps = e.pieces
        cuts = grid_cuts(e.shape, [p.box for p in ps])
        if cells(cuts) != [p.box for p in ps]:
            raise ValueError(f"tensor entry {e.dtype}{list(e.shape)}: its pieces are not a grid's cells in order")
        out["pieces"] = {"cuts": cuts, "xxh3": [p.xxh3 for p in ps],
                         "object": [p.object for p in ps], "offset": [p.offset for p in ps],
                         "length": [p.length for p in ps]}
    return out
