"""``ckptdelta hotload URL... SNAPSHOT`` and ``ckptdelta status URL...``: one command for a fleet of replicas.

As a managed service's hot-load API does: every replica is asked for one exact
version (``latest`` is resolved once), each goes on its own (one that fails,
refuses or cannot be reached does not stop the others), the newest request wins
(a replica busy with a hot-load to another version queues this one behind it:
loader/hotload_jobs.py), and the answer is a table with one row per replica:
its state, the version it serves, prepare and pause times, and what failed. The
exit status is 0 only when every replica is READY (or, without ``--wait``, has
accepted). Replicas come as URLs, or one per line from ``--replicas-file``
(blank lines and ``#`` comments skipped), or both. ``--json`` prints the
replicas' own answers instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ckptdelta.cli.console import CommandParser, guarded, one_line
from ckptdelta.cli.options import UsageError, number

#: Exit status when a replica failed, refused or could not be reached.
SOME_FAILED = 1


class _Intermixed(CommandParser):
    """Replica URLs may come before and after options (``URL --replicas-file F latest``): argparse alone takes
    the positionals once, and ``latest`` after an option would be an unrecognized argument."""

    _inner = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inner:      # parse_known_intermixed_args calls this twice itself
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_commands(subparsers: Any) -> None:
    h = subparsers.add_parser(
        "hotload", help="hot-load a snapshot on one replica or many",
        usage="ckptdelta hotload [options] URL... SNAPSHOT",
        description="Ask every replica to hot-load SNAPSHOT (POST /v1/hotload; 'latest' is resolved once, by the "
                    "first replica, and every replica gets that version; one busy with another hot-load queues "
                    "this one: the newest request wins) and print one row per replica: state, version, prepare "
                    "and pause times, what failed. Exit 0 when every replica is READY (without --wait: accepted), "
                    "1 otherwise.")
    h.add_argument("args", nargs="+", metavar="URL... SNAPSHOT",
                   help="replica URLs, then 'latest', a snapshot name (v00000042) or a version")
    h.add_argument("--replicas-file", metavar="FILE", action="append", default=[],
                   help="more replica URLs, one per line ('#' comments and blank lines skipped; repeatable)")
    h.add_argument("--wait", action="store_true",
                   help="wait for the replicas to answer (they may be starting), then until each is READY or FAILED")
    h.add_argument("--api-key", default=None, help="bearer key (default: $CKPTDELTA_API_KEY)")
    h.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait with --wait (default 600): for a replica to come up, then for its "
                        "hot-load, each replica its own; also the longest one request may take (at most 60)")
    h.add_argument("--await-commit", type=number(0, above=True, maximum=3600), default=None, metavar="SECONDS",
                   help="SNAPSHOT may be the version being published (not committed yet): each replica waits up to "
                        "SECONDS (at most 3600) for its commit, fetching its parts as they land, instead of "
                        "answering 404")
    h.add_argument("--json", action="store_true", help="print the replicas' answers as one JSON object")
    h.set_defaults(func=guarded(cmd_hotload, "hotload"))
    h.__class__ = _Intermixed

    s = subparsers.add_parser(
        "status", help="what one replica or many serve",
        description="GET /v1/status of every replica, all at once, and print one row per replica: state "
                    "(STARTING for one whose engine still loads), version, run, the last hot-load (UNREACHABLE "
                    "or REJECTED, and why, for one that did not answer with a replica's status: UNREACHABLE is "
                    "no answer at all). Exit 0 when every replica answered, 1 otherwise.")
    s.add_argument("urls", nargs="*", metavar="URL", help="replica URLs")
    s.add_argument("--replicas-file", metavar="FILE", action="append", default=[],
                   help="more replica URLs, one per line ('#' comments and blank lines skipped; repeatable)")
    s.add_argument("--api-key", default=None, help="bearer key (default: $CKPTDELTA_API_KEY)")
    s.add_argument("--timeout", type=float, default=30.0,
                   help="seconds each replica has to answer (default 30; they are asked at once)")
    s.add_argument("--json", action="store_true", help="print the replicas' answers as one JSON object")
    s.set_defaults(func=guarded(cmd_status, "status"))
    s.__class__ = _Intermixed


def replica_urls(urls: list[str], files: list[str]) -> list[str]:
    """URLs from the command line and the files, in order, each once."""
    out = list(urls)
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise UsageError(f"--replicas-file {path}: {e.strerror or e}") from None
        out += [ln.split("#", 1)[0].strip() for ln in lines]
    out = list(dict.fromkeys(u.rstrip("/") for u in out if u))
    for u in out:
        if not u.startswith(("http://", "https://")):
            raise UsageError(f"replica URL {u!r} is not http(s)://HOST:PORT")
    if not out:
        raise UsageError("give the replicas: URLs, or --replicas-file FILE")
    return out


def _check_timeout(args: argparse.Namespace) -> None:
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be > 0 seconds")


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("CKPTDELTA_API_KEY") or None


def cmd_hotload(args: argparse.Namespace) -> int:
    from ckptdelta.loader.client import RolloutClient

    *urls, snapshot = args.args
    if snapshot.startswith(("http://", "https://")):
        raise UsageError(f"the last argument is the snapshot ('latest', a name or a version), not {snapshot!r}")
    urls = replica_urls(urls, args.replicas_file)
    _check_timeout(args)
    target: str | int = int(snapshot) if snapshot.isdigit() else snapshot
    # no request outlasts the whole wait: a hung replica is given up on within --timeout, like the others; a
    # starting one is waited for as the clients wait for it (loader/fleet.py, StartWait), with --wait only
    with RolloutClient(urls, api_key=_api_key(args), timeout=min(60.0, args.timeout),
                       ready_timeout=args.timeout if args.wait else 0.0) as client:
        states = client.hotload_each(target, wait=args.wait, timeout=args.timeout, await_commit_s=args.await_commit)
    ok = ("READY",) if args.wait else ("READY", "QUEUED", "PREPARING", "SWAPPING")
    bad = {u: st for u, st in states.items() if st.get("state") not in ok or "error" in st}
    if args.json:
        print(json.dumps(states, indent=2))
    else:
        print(hotload_table(states, snapshot))
    if bad:
        first = next(iter(bad.items()))
        print(f"ckptdelta hotload: error: {len(bad)} of {len(states)} replicas not "
              f"{'READY' if args.wait else 'accepting'}; {first[0]}: {_what_failed(first[1])}", file=sys.stderr)
        return SOME_FAILED
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ckptdelta.loader.client import RolloutClient

    urls = replica_urls(args.urls, args.replicas_file)
    _check_timeout(args)
    with RolloutClient(urls, api_key=_api_key(args), timeout=args.timeout) as client:
        states = client.status()
    if args.json:
        print(json.dumps(states, indent=2))
    else:
        print(status_table(states))
    bad = [u for u, st in states.items() if "error" in st]
    if bad:
        print(f"ckptdelta status: error: {len(bad)} of {len(states)} replicas did not answer; {bad[0]}: "
              f"{one_line(states[bad[0]]['error'])}", file=sys.stderr)
        return SOME_FAILED
    return 0


# --- tables ------------------------------------------------------------------------------------------------

def _name(v: Any) -> str:
    from ckptdelta.delta.manifest import snapshot_name

    return snapshot_name(v) if isinstance(v, int) else "-" if v is None else str(v)


def _secs(x: Any) -> str:
    return f"{x:.3f}s" if isinstance(x, (int, float)) else "-"


def _what_failed(st: dict[str, Any]) -> str:
    return one_line(st.get("error") or st.get("reason") or "")


def _serves(st: dict[str, Any]) -> Any:
    """The version a replica serves after its answer: the target once READY, else the one it had."""
    if st.get("state") == "READY":
        return st.get("target_version")
    return st.get("from_version")


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + ("  " + r[-1] if r[-1] else "")
             for r in [header] + rows]
    return "\n".join(ln.rstrip() for ln in lines)


def hotload_table(states: dict[str, dict[str, Any]], requested: str) -> str:
    targets = sorted({st["target_version"] for st in states.values() if isinstance(st.get("target_version"), int)})
    counts: dict[str, int] = {}
    for st in states.values():
        counts[st.get("state", "?")] = counts.get(st.get("state", "?"), 0) + 1
    head = (f"hot-load of {', '.join(_name(t) for t in targets) or requested}"
            f"{f' ({requested})' if targets and requested != _name(targets[0]) else ''} on {len(states)} "
            f"replica{'s' if len(states) != 1 else ''}: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    rows = []
    for url, st in states.items():
        t = st.get("timings") or {}
        rows.append([url, str(st.get("state", "?")), _name(_serves(st)), _secs(t.get("prepare_s")),
                     _secs(t.get("pause_s")), _secs(st.get("duration_s")), _what_failed(st)[:200]])
    return head + "\n" + table(["replica", "state", "serves", "prepare", "pause", "total", "error"], rows)


def status_table(states: dict[str, dict[str, Any]]) -> str:
    rows = []
    for url, st in states.items():
        if "error" in st:
            rows.append([url, str(st.get("state", "UNREACHABLE")), "-", "-", "-", one_line(st["error"])[:200]])
            continue
        last = st.get("last_hotload") or {}
        last_s = (f"{last.get('state')} {_name(last.get('target_version'))}" if last else "-")
        why = (st.get("engine") or {}).get("failure") or last.get("reason") or ""
        rows.append([url, str(st.get("state")), _name(st.get("policy_version")), str(st.get("run_id") or "-"),
                     last_s, one_line(why)[:200]])
    return table(["replica", "state", "serves", "run", "last hot-load", "error"], rows)
