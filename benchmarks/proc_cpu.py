"""CPU time of a benchmark's processes by role, read from /proc, so that a run can say whose CPU a step spent.

On the 2 cores of ``benchmarks.lora`` the trainer, the replica, vLLM and the S3 server
share the machine: a method whose path needs more CPU is stretched by whatever else runs
meanwhile (vLLM's generation above all), while one bound by the link is not. A step's
wall time alone cannot tell those apart; the CPU each process spent in it can.

A role is a process and, by default, its descendants (``ip netns exec`` execs the
command it runs, so a peer's pid is the peer's own); ``descendants_as`` counts a role's
descendants under a role of their own instead (the replica's vLLM server). The times
are user + system of every live thread, in clock ticks (10 ms on Linux): a process that
ended between two readings is missing from the difference, so roles are read for
long-lived processes only. Where there is no ``/proc`` every reading is empty.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``; None once it has ended or where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after it follow its last ')'
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK
    except (IndexError, ValueError):
        return None


def cpu_by_role(roles: Mapping[str, int | None], *,
                descendants_as: Mapping[str, str] | None = None) -> dict[str, float]:
    """CPU seconds so far of each role's process tree (roles whose pid is None are left out), with the
    descendants of a role named in ``descendants_as`` counted under the role it maps to."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    stats = {int(p): s for p in pids if (s := _stat(p)) is not None}
    root_of = {pid: role for role, pid in roles.items() if pid is not None}
    below = descendants_as or {}
    out = {role: 0.0 for role in root_of.values()}
    out.update({role: 0.0 for r, role in below.items() if r in out})
    for pid, (_parent, cpu) in stats.items():
        role, p, seen = None, pid, 0
        while p in stats and seen < 4096:       # up the parent chain to the nearest role's process
            if p in root_of:
                role = root_of[p] if p == pid else below.get(root_of[p], root_of[p])
                break
            p, seen = stats[p][0], seen + 1
        if role is not None:
            out[role] += cpu
    return out


def spent(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each role spent between two readings."""
    return {k: max(0.0, after[k] - before.get(k, 0.0)) for k in after}
