"""Zstd frames of byte planes: what encodings 1-3 (sparse, dense_xor, raw) store, and how a reader vets them.

docs/FORMAT.md, "Byte planes" and "Zstandard frames". A frame's header declares
its content size; a reader checks it against the size the chunk entry implies
before decompressing, so a payload cannot make it allocate more than its own
(already validated) fields allow.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ckptdelta.delta import kernels
from ckptdelta.delta.errors import FormatError

_local = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor of ``level`` (a compressor is not thread-safe; building one per chunk costs)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return c


def decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def planes_needed(max_value: int) -> int:
    return max(1, (int(max_value).bit_length() + 7) // 8)


# RFC 8878: a block regenerates at most 128 KiB and takes at least 4 bytes (3-byte header,
# >= 1 byte of content), so no frame expands more than 32768-fold.
_ZSTD_BLOCK_MAX = 128 << 10
_ZSTD_MIN_BLOCK_BYTES = 4


def check_frame(frame: bytes | memoryview, expected: int, where: str) -> None:
    """Reject a zstd frame that cannot hold exactly ``expected`` bytes, from its header and length alone.

    Cheap (no decompression), so a reader can vet every frame of a record before it
    allocates the output: a hostile header cannot make it allocate more than the
    payload bytes it actually delivered could expand to."""
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: bad zstd frame ({e})") from None
    if size != expected:
        raise FormatError(f"{where}: zstd frame holds {size} bytes, {expected} expected")
    if len(frame) < _ZSTD_MIN_BLOCK_BYTES * -(-expected // _ZSTD_BLOCK_MAX):
        raise FormatError(f"{where}: a zstd frame of {len(frame)} bytes cannot hold {expected} bytes")


def unzstd(frame: bytes | memoryview, expected: int, where: str) -> bytes:
    """Decompress one zstd frame whose content size must be exactly ``expected``.

    The size is checked from the frame header before zstd allocates anything, so a
    corrupt or hostile payload cannot ask for more memory than the record's own
    (already validated) fields allow."""
    check_frame(frame, expected, where)
    try:
        out = decompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: corrupt zstd frame ({e})") from None
    if len(out) != expected:
        raise FormatError(f"{where}: zstd frame decoded to {len(out)} bytes, {expected} expected")
    return out


#: A dense or raw try is compressed only when its planes' order-0 estimate (kernels.planes_entropy_bytes) is
#: below this multiple of the best payload so far. zstd does not code bytes much below that estimate unless
#: it finds repeats the estimate misses, and on noise-like planes it lands some percent above it: the bar
#: sits below 1 by that much, so that where every element changes by noise-like steps (a LoRA step: sparse
#: wins) the tries, which cost as much as the rest of the encode, are skipped; planes whose order-0 entropy
#: is that high rarely hold long repeats (docs/PERFORMANCE.md, "The fast path on dense steps").
SURELY_LARGER = 0.92
#: The estimate itself reads every byte of the planes: as long as a zstd pass at a low level. Planes of more
#: than SAMPLE_BLOCK bytes are first estimated from every SAMPLE_STRIDE-th block of SAMPLE_BLOCK bytes (the
#: first of each plane at least; a smaller block's order-0 estimate errs low, to the side of a full
#: estimate); where that guess is SAMPLE_MARGIN times the bar above or more, the try is skipped on it. On
#: planes of one statistics (a tensor's step) the guess lands close to the full estimate, so the full
#: estimate decides every case it decided before except planes whose sampled blocks are unlike the rest (a
#: region left alone beside a reset one), where a try may now be skipped that the full estimate would have
#: compressed: bytes, never bits, are at stake.
SAMPLE_BLOCK = 1 << 12
SAMPLE_STRIDE = 8
SAMPLE_MARGIN = 1.05


def estimate(planes: np.ndarray, plane_len: int) -> float:
    """The planes' order-0 estimate from the sample a guess reads (every SAMPLE_STRIDE-th block of SAMPLE_BLOCK
    bytes), or from all of them where a plane is no longer than one such block."""
    if plane_len > SAMPLE_BLOCK:
        return kernels.planes_entropy_bytes(planes, plane_len, SAMPLE_BLOCK, SAMPLE_STRIDE)
    return kernels.planes_entropy_bytes(planes, plane_len, SAMPLE_BLOCK)


def may_beat(planes: np.ndarray, plane_len: int, best: float, best_estimate: float | None = None) -> bool:
    """Whether compressing ``planes`` may give fewer than ``best`` bytes.

    With ``best_estimate``, the best payload's own planes estimated the same way (a sparse chunk's gaps and
    steps), the two estimates are weighed like for like: zstd's overhead over the estimate, which differs
    with the planes' statistics, cancels out, so the bar needs no margin for it. Else the estimate of
    ``planes`` is weighed against the payload itself (see :data:`SURELY_LARGER`)."""
    if best_estimate is not None:
        return estimate(planes, plane_len) < best_estimate
    bar = SURELY_LARGER * best
    if plane_len > SAMPLE_BLOCK and estimate(planes, plane_len) >= SAMPLE_MARGIN * bar:
        return False
    return kernels.planes_entropy_bytes(planes, plane_len, kernels.ENTROPY_BLOCK) < bar
