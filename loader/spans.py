"""A request's span: every policy version a replica served between the request's admission and its completion.

An async RL trainer's off-policy correction trusts ``engine_data.policy_versions``:
a version left out of it is a silent lie (tokens it generated are taken for
another's). So the span is not reconstructed from swap counters and guesses about
what a request saw; it is read off one record, kept by construction:

- :class:`VersionLog` is the sequence of versions a replica served, in order. The
  only writer is the hot swapper's ``version`` (loader/hotswap.py): it is set
  inside the swap's pause, after the new bits are in and before anything computes
  with them (the reference gate still held, vLLM not resumed yet), so a version
  is in the log before the first step that uses it. A version set again to what it
  already is (a rollback that restored it) adds nothing; a version that becomes
  unknown is logged as ``None``; one served again later (a rollback to it) is
  logged again, so the span stays in the order the versions were served.
- A request opens a :class:`Span` at its admission: the position of the version
  served at that moment, the one before the swap when it is admitted inside a
  pause (the old weights may still compute for it: vLLM's steps run until its
  pause returns). Its span ends at its completion: its last forward step where
  the engine runs the steps (:meth:`Span.ran`, the reference decode loop), else
  when the engine answered it (vLLM). The reported versions are the log from the
  start to the end: the version at admission and every version served after it,
  none skipped, whatever the interleaving of admission, pause, resume and
  completion.

An engine whose requests each run on one version by construction (vLLM's LoRA
slots: a slot is rewritten only when no request holds it) gives them a
:func:`pinned` span instead.

The log keeps the versions from the oldest open span's start on (and the current
one), so a request that outlives any number of swaps still reports all of them.
"""

from __future__ import annotations

import threading
from typing import Any


class VersionLog:
    """The versions one replica served, in order; positions are absolute (they survive trimming)."""

    def __init__(self, version: int | None) -> None:
        self._lock = threading.Lock()
        self._entries: list[int | None] = [version]
        self._base = 0                       # position of _entries[0]
        self._position = 0                   # position of the version served now
        self._open: dict[int, int] = {}      # start position -> spans open from it
        self.current: int | None = version   # the version served now

    @property
    def position(self) -> int:
        """Where the version served now sits in the log."""
        return self._position

    def serve(self, version: int | None) -> None:
        """The replica serves ``version`` from now on (called before anything computes with it)."""
        with self._lock:
            if version == self.current:
                return
            self._entries.append(version)
            self._position += 1
            self.current = version
            self._trim()

    def open(self) -> "Span":
        """A request admitted now: its span starts at the version served now."""
        with self._lock:
            start = self._position
            self._open[start] = self._open.get(start, 0) + 1
            return Span(self, start, self.current)

    def since(self, position: int) -> list[int | None]:
        """The versions served from ``position`` to now (ValueError when they are no longer kept: hold a span
        open from there)."""
        with self._lock:
            if not self._base <= position <= self._position:
                raise ValueError(f"versions from position {position} are not kept (kept: {self._base} to "
                                 f"{self._position})")
            return self._entries[position - self._base:]

    def _close(self, span: "Span") -> list[int | None]:
        with self._lock:
            end = self._position if span.end is None else span.end
            versions = self._entries[span.start - self._base:end - self._base + 1]
            n = self._open[span.start] - 1
            if n:
                self._open[span.start] = n
            else:
                del self._open[span.start]
                self._trim()
            return versions

    def _trim(self) -> None:
        keep = min(self._open, default=self._position)
        keep = min(keep, self._position)
        if keep > self._base:
            del self._entries[:keep - self._base]
            self._base = keep

    def __repr__(self) -> str:
        return f"VersionLog(current={self.current!r}, position={self._position})"


class Span:
    """One request's versions: open from its admission (:meth:`VersionLog.open`), closed at its completion."""

    def __init__(self, log: VersionLog | None, start: int, admitted: int | None,
                 versions: list[int | None] | None = None) -> None:
        self._log, self.start = log, start
        self.admitted = admitted             # the version served at admission
        self.end: int | None = None          # the position of the request's last step, where the engine knows it
        self._versions = versions            # once closed
        self._closing = threading.Lock()

    def ran(self) -> None:
        """The request computes now, inside a forward step no swap can interleave (the reference gate held):
        its span reaches at least the version served now, and ends there unless it computes again."""
        if self._log is not None:
            self.end = self._log.position

    def close(self) -> list[int | None]:
        """The request completed: its versions, in the order they were served (the same list when called
        again)."""
        with self._closing:
            if self._versions is None:
                self._versions = self._log._close(self)
            return list(self._versions)

    @property
    def closed(self) -> bool:
        return self._versions is not None

    def __repr__(self) -> str:
        return f"Span(start={self.start}, end={self.end}, versions={self._versions!r})"


def pinned(version: int | None) -> Span:
    """The span of a request that runs on ``version`` alone by construction (a vLLM LoRA slot)."""
    return Span(None, 0, version, [version])

