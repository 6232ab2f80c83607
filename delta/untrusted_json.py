"""JSON a reader takes from a bucket, parsed within stated bounds (docs/FORMAT.md, "Bounds a reader enforces").

``json.loads`` alone is not safe on bytes whoever can write to the bucket chose:
it recurses once per nesting level (a deep document raises RecursionError, and
under a raised recursion limit can overflow the C stack), it keeps the last of
repeated keys silently (one flipped bit turning 'layers.1' into 'layers.0' would
swap two tensors' entries), it takes ``NaN`` and ``Infinity``, and it guesses
UTF-16 or UTF-32 from the first bytes. Every JSON document a reader takes from a
bucket (manifests, HEAD, RUN.json, a delta object's footer, a shard's safetensors
header) goes through :func:`loads`: the size limit before anything else, strict
UTF-8, the nesting depth from a scan of the raw bytes before the parse (so the
process's recursion limit does not matter), no repeated keys, no NaN or Infinity
(a number's digits are bounded by CPython's own int limit). Every refusal is the
caller's :class:`CkptDeltaError` class, naming the object.

Memory: CPython holds a parsed document in at most ``PARSE_MEMORY_FACTOR`` times
its bytes (measured worst case ~25x, a document of empty objects; a manifest ~5x),
so each kind's size limit is also its memory limit.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ckptdelta.delta.errors import CkptDeltaError, FormatError

#: Deepest nesting a reader parses. The format's documents nest at most 5 levels (a manifest: the document,
#: ``tensors``, an entry, its ``pieces``, their ``cuts``); the margin leaves room for the user's metadata and
#: future fields.
MAX_DEPTH = 16
#: Bytes of memory a parse may hold per byte of the document (docs/FORMAT.md, stated bound).
PARSE_MEMORY_FACTOR = 32

_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_SCAN_BYTES = 256 << 10


def loads(data: bytes | bytearray | memoryview, *, what: str, max_bytes: int,
          error: type[CkptDeltaError] = FormatError, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in ``data``, or ``error`` naming ``what`` and the broken bound."""
    if len(data) > max_bytes:
        raise error(f"{what}: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    data = bytes(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what}: not UTF-8 JSON (byte {e.start}: {e.reason})") from None
    depth = nesting_depth(data, stop_above=max_depth)
    if depth > max_depth:
        raise error(f"{what}: JSON nested deeper than {max_depth} levels (the format nests at most 5)")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:   # JSONDecodeError is a ValueError; RecursionError: belt and braces
        raise error(f"{what}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def nesting_depth(data: bytes, *, stop_above: int | None = None) -> int:
    """How deep the brackets outside strings nest: exact for valid JSON, for invalid JSON an estimate that the
    parse then refuses anyway. One pass over the bytes in slices of ``_SCAN_BYTES`` (a few times that in
    memory, whatever the document's size), stopping once deeper than ``stop_above``.

    A quote delimits a string unless an odd run of backslashes precedes it; a bracket counts unless it lies
    between delimiting quotes. Without a backslash only quotes and brackets matter, so they are all scanned."""
    escapes = b"\\" in data
    if not escapes:
        data = data.translate(None, _NOT_STRUCTURE)
    a = np.frombuffer(data, np.uint8)
    depth = deepest = 0
    quotes = 0            # delimiting quotes so far (odd: inside a string)
    backslashes = 0       # the run of backslashes the previous slice ended with
    for s in range(0, len(a), _SCAN_BYTES):
        c = a[s: s + _SCAN_BYTES]
        delimits = c == 34
        if escapes:
            idx = np.arange(len(c), dtype=np.int32)
            is_bs = c == 92
            last_other = np.maximum.accumulate(np.where(is_bs, np.int32(-1 - backslashes), idx))  # <= i, not "\\"
            delimits[0] &= backslashes % 2 == 0
            delimits[1:] &= (idx[:-1] - last_other[:-1]) % 2 == 0      # an even run of backslashes before i
            backslashes = len(c) - 1 - int(last_other[-1]) if not is_bs.all() else backslashes + len(c)
            del idx, is_bs, last_other
        inside = (np.cumsum(delimits, dtype=np.int32) + quotes) & 1
        run = np.cumsum(np.where(inside == 0, _STEP[c], np.int8(0)), dtype=np.int32) + depth
        deepest = max(deepest, int(run.max()))
        depth, quotes = int(run[-1]), (quotes + int(delimits.sum())) & 1
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup[:200]!r}")
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
