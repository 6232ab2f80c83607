"""What every chunk encoding provides, and the registry the chunk coder iterates.

Why: an encoding is an id in the record's chunk table (docs/FORMAT.md, "Chunk
encodings") plus everything the code must know about it: which chunk-table fields
are valid, how the chunk coder tries it, how it decodes, which kernels a warm-up
must compile, what it costs the publisher's codec choice. Each encoding keeps all
of that in one module of this package, which registers an :class:`Encoding` as it
is imported (as zarr's codecs do), and the chunk coder (delta/chunks.py), the
record parser (delta/record.py), the warm-up (delta/warmup.py) and the cost model
(publisher/codec_choice.py) iterate the registry instead of switching on ids.

The interface is glue at the level of one chunk, never of one element: the hot
loops stay in the numba kernels (kernels.py, ctx_*.py, gctx.py, pctx.py), pure
functions over numpy arrays, which the encodings call once per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ckptdelta.delta.dtypes import DType
    from ckptdelta.delta.record import ChunkEntry

#: When the chunk coder tries an encoding: in both codec modes, only with the context coder
#: (``encode(context=True)``) or only without it (the fast path); None: never (a decoder only, or the
#: chunk coder takes it itself).
ALWAYS, CONTEXT, FAST = "always", "context", "fast"


class Candidate(NamedTuple):
    """One encoding's payload for a chunk and the chunk-table fields it goes with."""

    encoding: int
    planes_a: int
    planes_b: int
    count: int
    payload: bytes
    #: The order-0 estimate (frames.estimate) of the byte planes the payload codes, where the encoding took
    #: one: a later try then weighs its own planes against it, like for like (frames.may_beat).
    estimate: float | None = None


@dataclass(frozen=True)
class Cost:
    """What an encoding costs, for the publisher's choice between the codecs (publisher/codec_choice.py).

    The chooser measures each codec's encode and bytes itself, delta by delta; it takes from here
    the shape of the cost, which it cannot measure on the trainer: how much more a changed element
    costs than a scanned one, a replica's decode, and the priors used before it measured both codecs.
    Only the encoding that stands for a codec (``ckptdelta.delta.chunks.codec_encoding``) needs one."""

    #: Encode work per changed element, in units of one scanned element (the publisher's unit of work).
    work_per_changed: float
    #: A replica's decode (fetched records -> staged changes, digests checked) in units of the same codec's
    #: encode work: (per element, per changed element).
    decode_work: tuple[float, float]
    #: Encode seconds per unit of work and stored bytes per changed element, relative to the context
    #: coder's as first fitted (encoding 4): the chooser's ratio of the codecs before it has measured one.
    prior_per_work: float
    prior_bytes_per_changed: float


class Chunk:
    """One chunk being encoded: the bits, and what the tries found so far (shared, so no pass repeats).

    ``old``/``new``/``grand``: the chunk's bits in the parent (None: no parent), the new version and the
    grandparent (None: not given). The chunk coder fills ``changed`` (changed elements), ``sparse_parts``
    (encoding 1's gaps, steps and their maxima) and ``best_length`` (the smallest payload so far, which
    tries compare against before they spend time); a context coder's scan (:meth:`Encoding.scan`) fills
    ``scan_payload``, ``beats_sparse`` and ``changed_nan`` on the way; ``best_estimate`` is the smallest
    payload's planes estimate (``Candidate.estimate``), None where its encoding took none. ``alone``: the
    fast path's own encoding is the only one tried (the dense and raw tries lost on this tensor's last step),
    so it makes no estimate for them. ``dense_step``: the fast path codes this chunk as dense steps (encoding
    7) instead of sparse (most of its elements changed), so no gaps were extracted (``sparse_parts`` None)."""

    __slots__ = ("old", "new", "grand", "dt", "level", "n", "changed", "sparse_parts", "best_length",
                 "best_estimate", "scan_payload", "beats_sparse", "changed_nan", "alone", "dense_step")

    def __init__(self, old: np.ndarray | None, new: np.ndarray, dt: "DType", level: int,
                 grand: np.ndarray | None) -> None:
        self.old = old                  # one statement each: a tuple assignment costs more, on every chunk
        self.new = new
        self.dt = dt
        self.level = level
        self.grand = grand
        self.n = new.shape[0]
        self.changed = -1
        self.sparse_parts: tuple | None = None
        self.best_length: float = math.inf
        self.best_estimate: float | None = None
        self.scan_payload: bytes | None = None
        self.beats_sparse = False
        self.changed_nan: bool | None = None
        self.alone = False
        self.dense_step = False


class Encoding:
    """One chunk encoding of docs/FORMAT.md. Subclasses set the class attributes and override what applies."""

    #: The id in the chunk table and the name FORMAT.md gives it (``EncodedTensor.encoding_counts``).
    id: int
    name: str
    #: Whether a chunk of it needs the parent's bits (and the record the has-parent flag), or the
    #: grandparent's too (a reader must be given the tensor before its parent: encoding 6; the chunk coder
    #: tries it only where its caller gave them).
    needs_parent = True
    needs_grandparent = False
    #: Whether the entry's ``count`` is the number of changed elements, so a stager can size its arrays
    #: before decoding (False: raw, whose count is the chunk's elements).
    count_is_changes = True
    #: Whether :meth:`decode` fills arrays it is given (of ``count`` elements) instead of new ones.
    decodes_into = True
    #: Whether :meth:`decode_dense` writes every element's new bits itself (else a dense stage decodes the
    #: changes and scatters them over a copy of the parent's bits).
    decodes_dense = False
    #: Whether the chunk coder tries it: ALWAYS, CONTEXT (with the context coder only), FAST (without it) or None.
    tried: str | None = None
    #: Its place among the tries (ascending): of two payloads of one size, the earlier encoding's is kept.
    order = 100
    #: A context coder (encodings 4, 5): its encoder visits every element, so the chunk coder lets the one
    #: ``ckptdelta.delta.chunks.CONTEXT_ENCODING`` names count the changes (:meth:`scan`); the others are never tried.
    scans = False
    #: The publisher's cost model of the codec this encoding stands for, if any.
    cost: Cost | None = None

    def check_entry(self, planes_a: int, planes_b: int, count: int, n: int, itemsize: int, has_parent: bool,
                    length: int, dtype_name: str) -> str | None:
        """What is wrong with a chunk-table entry of this encoding for a chunk of ``n`` elements, or None.

        Runs on every parsed header, before any payload is read: the fields decide what a decoder
        allocates, so each is held to what FORMAT.md allows here."""
        if self.needs_parent and not has_parent:
            return f"{self.name} chunk in a record without parent"
        return self.check_fields(planes_a, planes_b, count, n, itemsize, length, dtype_name)

    def check_fields(self, planes_a: int, planes_b: int, count: int, n: int, itemsize: int, length: int,
                     dtype_name: str) -> str | None:
        """:meth:`check_entry` past the parent check: the fields' ranges (FORMAT.md's table), and the
        payload's length where the encoding fixes it."""
        return None

    def scan(self, chunk: Chunk) -> bool:
        """A context coder's encode of ``chunk``, which finds its changes on the way: fills the chunk's
        ``changed``, ``sparse_parts``, ``scan_payload``, ``beats_sparse`` and, where it looked,
        ``changed_nan``. False (nothing filled) where the encoding does not serve the dtype."""
        return False

    def encode(self, chunk: Chunk) -> Candidate | None:
        """This encoding's payload of ``chunk``, or None where it does not apply or would not beat
        ``chunk.best_length`` (an encoding may skip the work when it can tell it loses). Called by the
        chunk coder in try order after the changes are counted (``chunk.changed`` >= 1), or for a chunk
        without parent (``chunk.old`` None) when the encoding needs none."""
        return None

    def decode(self, entry: "ChunkEntry", payload: bytes | memoryview, old: np.ndarray, dt: "DType", where: str,
               out: "tuple[np.ndarray, np.ndarray] | None", grand: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Chunk-local positions (int64) and new bits of a chunk encoded against ``old`` (the chunk's
        parent bits), into ``out`` when given (only where :attr:`decodes_into`). ``payload`` has been
        checked against the entry's length and checksum, the entry's fields by :meth:`check_entry`;
        anything else wrong in the payload is a :class:`~ckptdelta.delta.errors.FormatError` naming ``where``."""
        raise NotImplementedError(f"{where}: encoding {self.name} does not decode")

    def decode_dense(self, entry: "ChunkEntry", payload: bytes | memoryview, old: np.ndarray, dt: "DType",
                     where: str, out: np.ndarray, grand: np.ndarray | None) -> None:
        """Every element's new bits of a chunk encoded against ``old``, written into ``out`` (``old``'s length):
        for an encoding whose chunks change most of their elements (:attr:`decodes_dense`), a dense stage
        without the positions and values of every change. Checked as :meth:`decode` checks."""
        raise NotImplementedError(f"{where}: encoding {self.name} does not decode densely")

    def check_whole(self, entry: "ChunkEntry", payload: bytes | memoryview, n: int, dt: "DType",
                    where: str) -> None:
        """For an encoding that needs no parent: refuse a payload that cannot hold ``n`` elements, from
        its framing alone, before the caller allocates the tensor."""
        raise NotImplementedError(f"{where}: a {self.name} chunk needs its parent")

    def decode_whole(self, entry: "ChunkEntry", payload: bytes | memoryview, n: int, dt: "DType",
                     where: str) -> np.ndarray:
        """For an encoding that needs no parent: the chunk's ``n`` new bits."""
        raise NotImplementedError(f"{where}: a {self.name} chunk needs its parent")

    def warm_up(self, old: np.ndarray, new: np.ndarray, grand: np.ndarray, dt: "DType") -> None:
        """Run this encoding's own kernels once on these bits of ``dt``, checked bit-exact, so numba
        compiles (or loads) them before a real chunk needs them (delta/warmup.py).

        Nothing by default: the warm-up's round trips through the codec reach the kernels of every
        encoding the chunk coder picks there. An encoding they may not reach (one the coder no longer
        writes, or one that needs an input they do not give) runs its kernels here."""

    def __repr__(self) -> str:
        return f"<encoding {self.id} {self.name}>"


class LayoutEncoding(Encoding):
    """An encoding defined for some float dtypes only, whose ``planes_a``/``planes_b`` are fixed by the
    dtype (its mantissa and exponent bits: encodings 4, 5, 6)."""

    #: dtype name -> (planes_a, planes_b)
    layout: dict[str, tuple[int, int]] = {}

    def check_fields(self, planes_a, planes_b, count, n, itemsize, length, dtype_name):
        if not (1 <= count <= n and self.layout.get(dtype_name) == (planes_a, planes_b)):
            return (f"{self.name} chunk fields out of range for {dtype_name or 'this dtype'} "
                    f"(count={count}, planes={planes_a}/{planes_b})")
        return None


class Registry:
    """The encodings by id. Modules register theirs when imported (``ckptdelta.delta.encodings`` imports the
    built-in ones); the sets below are recomputed on every change, so callers read them as attributes."""

    def __init__(self) -> None:
        self.by_id: dict[int, Encoding] = {}
        #: id -> name, the same dict object throughout (``ckptdelta.delta.record.ENCODING_NAMES``).
        self.names: dict[int, str] = {}
        self.in_order: tuple[Encoding, ...] = ()
        self.needs_grandparent: frozenset[int] = frozenset()
        self.counts_elements: frozenset[int] = frozenset()
        self.decodes_into: tuple[Encoding, ...] = ()
        #: Bumped on every change: what callers cache from the registry is keyed by it.
        self.version = 0

    def register(self, enc: Encoding) -> Encoding:
        """Add ``enc``; an id or a name taken already is a programming error (ids never change meaning)."""
        if not (isinstance(enc.id, int) and 0 <= enc.id <= 255):
            raise ValueError(f"{enc!r}: an encoding id is one byte of the chunk table (0..255)")
        if enc.id in self.by_id or enc.name in self.names.values():
            raise ValueError(f"{enc!r}: id {enc.id} or name {enc.name!r} is registered already "
                             f"({self.by_id.get(enc.id)!r})")
        if enc.tried not in (None, ALWAYS, CONTEXT, FAST):
            raise ValueError(f"{enc!r}: tried must be None, {ALWAYS!r}, {CONTEXT!r} or {FAST!r}, not {enc.tried!r}")
        self.by_id[enc.id] = enc
        self._update()
        return enc

    def unregister(self, enc: Encoding) -> None:
        """Remove ``enc`` (an encoding a test added)."""
        if self.by_id.get(enc.id) is not enc:
            raise ValueError(f"{enc!r} is not registered")
        del self.by_id[enc.id]
        self._update()

    def _update(self) -> None:
        self.names.clear()
        self.names.update((i, self.by_id[i].name) for i in sorted(self.by_id))
        self.in_order = tuple(sorted(self.by_id.values(), key=lambda e: (e.order, e.id)))
        self.needs_grandparent = frozenset(i for i, e in self.by_id.items() if e.needs_grandparent)
        self.counts_elements = frozenset(i for i, e in self.by_id.items() if not e.count_is_changes)
        self.decodes_into = tuple(self.by_id[i] for i in sorted(self.by_id) if self.by_id[i].decodes_into)
        self.version += 1

    def get(self, encoding_id: int) -> Encoding | None:
        return self.by_id.get(encoding_id)

    def __iter__(self):
        """The encodings in id order."""
        return iter([self.by_id[i] for i in sorted(self.by_id)])


REGISTRY = Registry()
register = REGISTRY.register
