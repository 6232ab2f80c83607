"""Cutting a stream of bytes into pieces that double in size: a publisher's delta parts, a replica's fetch
batches, and the publisher's prediction of both (publisher/codec_choice.py).

The first piece is small, so that the next stage (an upload, a decode) starts early; each next one may be
twice the last, so that a stream of GBs is cut into few pieces; and none holds more than a share of the whole,
since the last piece is worked on only once all of it is there. publisher/ and loader/ cut by these two
functions, each with its own sizes (the measurements behind them: docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Iterator


def capped(total: int, most: int, least: int, share: int) -> int:
    """The largest piece of a stream of ``total`` bytes: ``most``, or 1/``share`` of the total where that is
    less, but never under ``least`` (nor under 1)."""
    return max(1, min(most, max(least, total // share)))


def limits(first: int, most: int) -> Iterator[int]:
    """Each piece's size limit in turn: ``first``, then twice the last, at most ``most``."""
    limit = min(most, first)
    while True:
        yield limit
        limit = min(most, 2 * limit)
