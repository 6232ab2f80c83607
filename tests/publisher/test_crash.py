"""Crash consistency: a publisher SIGKILLed at random moments never leaves a run unreadable or rewritten.

Each trial forks a publisher child (tests/crashers/) that continues the run from
the bucket and publishes a few versions; the test kills it with SIGKILL at a
random moment: at a chosen storage write (just before it, while it runs, or
right after it returns) or after a random delay into a chosen publish. Kills
target anchor and delta publishes in turn. After every kill the test checks,
with readers of its own:

* the committed versions are consecutive and the newest is the last one the
  child acknowledged or the one it was publishing (a commit whose answer the
  kill swallowed); a fresh SnapshotReader finds it as ``latest`` and reads it
  bit-exact against ``weights_for(seed, v)``, and ``verify`` passes;
* no manifest, and not RUN.json, was ever rewritten (xxh3 of their bytes);
* ``gc`` (grace 0) leaves no object that no manifest references, nothing else
  on the local disk either, and every snapshot it keeps reads bit-exact;
* the next child (a restarted publisher) finds that same latest version and
  commits the next one (the child reports an error otherwise).

Figures are printed (``pytest -s``); the test asserts zero violations.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import xxhash

from ckptdelta.delta.errors import ObjectNotFoundError
from ckptdelta.delta.manifest import HEAD_KEY, RUN_KEY, Head, manifest_key
from ckptdelta.delta.storage import Store
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher, collect
from ckptdelta.publisher.runs import committed_versions, read_manifest
from tests.crashers.publish_loop import ANCHOR_EVERY, weights_for
from tests.crashers.zygote import Zygote

SEED = int(os.environ.get("CKPTDELTA_CRASH_SEED", "20240601"))
DELTA_WRITES = 3            # delta object, manifest, HEAD


def _xxh(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@dataclass
class Figures:
    label: str
    trials: int = 0
    kills: int = 0
    kills_by: Counter = field(default_factory=Counter)       # (kind, phase)
    modes: Counter = field(default_factory=Counter)
    clean_exits: int = 0
    acked_commits: int = 0
    unacked_commits: int = 0      # committed, but the kill came before the child could say so
    head_lag: int = 0             # killed between the manifest and HEAD
    gc_deleted_objects: int = 0
    gc_deleted_versions: int = 0
    snapshots_checked: int = 0
    violations: list[str] = field(default_factory=list)

    def report(self) -> str:
        kinds = Counter()
        for (kind, _phase), n in self.kills_by.items():
            kinds[kind] += n
        lines = [f"crash consistency [{self.label}] seed={SEED}",
                 f"  trials={self.trials} kills={self.kills} (anchor publishes {kinds['anchor']}, delta publishes "
                 f"{kinds['delta']}, between publishes {kinds['none']}) modes={dict(self.modes)}",
                 f"  clean exits={self.clean_exits} acked commits={self.acked_commits} "
                 f"commits landed but unacked={self.unacked_commits} head lagging after kill={self.head_lag}",
                 f"  gc deleted {self.gc_deleted_objects} debris objects and {self.gc_deleted_versions} old versions; "
                 f"snapshots read back bit-exact={self.snapshots_checked}",
                 "  kills by (kind, phase): "
                 + ", ".join(f"{k}/{p}={n}" for (k, p), n in sorted(self.kills_by.items())),
                 f"  violations={len(self.violations)}"]
        lines += [f"    - {v}" for v in self.violations[:20]]
        return "\n".join(lines)


class Campaign:
    """One run, one zygote, ``kills`` SIGKILLs; every check after every trial."""

    def __init__(self, url: str, opts: dict, zygote: Zygote, label: str, seed: int = SEED, *,
                 read_kept_every: int = 1):
        self.url, self.opts, self.zygote = url, opts, zygote
        self.read_kept_every = read_kept_every   # trials between bit-exact reads of every kept snapshot
        self.rng = random.Random(seed)
        self.seed = seed
        self.fig = Figures(label)
        self.store = Store.from_url(url, opts)
        self.manifest_xxh3: dict[int, str] = {}
        self.run_json: bytes | None = None
        self.anchor_writes = 9     # refined once the first anchor is committed
        self.durations = {"anchor": 0.05, "delta": 0.02}
        self.reported_stray: list[str] = []

    # --- planning a kill ------------------------------------------------------------

    def _state(self) -> tuple[int | None, int | None]:
        vs = committed_versions(self.store)
        if not vs:
            return None, None
        m = read_manifest(self.store, vs[-1], None)
        return vs[-1], m.anchor_version

    def _predicted_kinds(self, last: int | None, anchor: int | None, n: int) -> list[str]:
        out = []
        for v in range(0 if last is None else last + 1, (0 if last is None else last + 1) + n):
            if anchor is None or v - anchor >= ANCHOR_EVERY:
                out.append("anchor")
                anchor = v
            else:
                out.append("delta")
        return out

    def _writes(self, kind: str) -> int:
        return self.anchor_writes if kind == "anchor" else DELTA_WRITES

    # --- one trial ------------------------------------------------------------------

    def trial(self) -> None:
        fig, rng = self.fig, self.rng
        fig.trials += 1
        last, anchor = self._state()
        kinds = self._predicted_kinds(last, anchor, 2 * ANCHOR_EVERY)
        want = "anchor" if fig.trials % 2 else "delta"
        j = kinds.index(want)
        n_publish = j + 1 + rng.randint(0, 1)
        mode = "timer" if rng.random() < 0.4 else rng.choice(["before", "during", "after"])
        fig.modes[mode] += 1
        kill = None
        if mode != "timer":
            before = sum(self._writes(k) for k in kinds[:j]) + (1 if last is None else 0)  # RUN.json
            kill = {"op": before + rng.randint(1, self._writes(want)), "when": mode}
        delay = rng.uniform(0.0, 1.2 * self.durations[want])
        self.zygote.spawn(url=self.url, storage_options=self.opts, seed=self.seed, n_publish=n_publish, kill=kill)

        events = []
        begin_t: dict[int, float] = {}
        killed_by_timer = False
        deadline = time.monotonic() + 300
        while True:
            ev = self.zygote.next_event(max(0.1, deadline - time.monotonic()))
            if ev is None:
                self.zygote.kill_child()
                fig.violations.append(f"trial {fig.trials}: child hung for 300s; killed")
                continue
            events.append(ev)
            if ev["ev"] == "EXITED":
                break
            if ev["ev"] == "BEGIN":
                begin_t[ev["v"]] = ev["t"]
                v0 = (0 if last is None else last + 1)
                if mode == "timer" and ev["v"] == v0 + j:
                    time.sleep(delay)
                    killed_by_timer = self.zygote.kill_child()
            if ev["ev"] == "COMMIT" and ev["v"] in begin_t:
                k = ev["kind"]
                self.durations[k] = max(self.durations[k], ev["t"] - begin_t[ev["v"]])
        self.zygote.reap()
        self._check(last, events, want, killed_by_timer)

    # --- checks ---------------------------------------------------------------------------

    def _check(self, last_before: int | None, events: list[dict], target: str, killed_by_timer: bool) -> None:
        fig = self.fig
        where = f"trial {fig.trials}"
        exited = events[-1]
        for ev in events:
            if ev["ev"] == "ERROR":
                fig.violations.append(f"{where}: the child failed: {ev['error']}")
            if ev["ev"] == "OPEN" and ev["last"] != last_before:
                fig.violations.append(f"{where}: restarted publisher found last version {ev['last']}, "
                                      f"the bucket's is {last_before}")
        commits = [ev for ev in events if ev["ev"] == "COMMIT"]
        begins = [ev["v"] for ev in events if ev["ev"] == "BEGIN"]
        fig.acked_commits += len(commits)
        acked = commits[-1]["v"] if commits else last_before
        inflight = begins[-1] if begins and (not commits or begins[-1] != commits[-1]["v"]) else None
        was_killed = exited["signal"] == 9
        if exited["code"] == 0:
            fig.clean_exits += 1
        elif not was_killed and exited["code"] != 3:
            fig.violations.append(f"{where}: child exited with {exited}")

        vs = committed_versions(self.store)
        latest = vs[-1] if vs else None
        if vs and vs != list(range(vs[0], vs[-1] + 1)):
            fig.violations.append(f"{where}: committed versions are not consecutive: {vs}")
        allowed = {acked} | ({inflight} if inflight is not None else set())
        if latest not in allowed:
            fig.violations.append(f"{where}: latest committed is {latest}, expected one of {sorted(allowed, key=str)}")
        if inflight is not None and latest == inflight:
            fig.unacked_commits += 1

        if was_killed:
            fig.kills += 1
            if inflight is None:
                fig.kills_by[("none", "between publishes")] += 1
            else:
                kind = self._predicted_kinds(acked, self._anchor_of(acked), 1)[0]
                fig.kills_by[(kind, self._phase(inflight, latest))] += 1

        self._check_immutable(vs, where)
        if latest is None:
            return
        head = self._head(where)
        if head is not None and head < latest:
            fig.head_lag += 1
        if head is not None and head > latest:
            fig.violations.append(f"{where}: HEAD names version {head}, beyond the newest manifest {latest}")

        reader = SnapshotReader(self.url, storage_options=self.opts)
        try:
            if reader.latest() != latest:
                fig.violations.append(f"{where}: reader's latest is {reader.latest()}, not {latest}")
            self._check_exact(reader, latest, where)
            reader.verify(latest)
        except Exception as e:  # noqa: BLE001 - any failure to read a committed snapshot is a violation
            fig.violations.append(f"{where}: committed snapshot {latest} unreadable: {type(e).__name__}: {e}")
        self._gc_and_check(where, read_kept=fig.trials % self.read_kept_every == 0 or not events
                           or events[-1]["code"] == 0)
        if self.anchor_writes == 9:
            for v in vs:
                m = read_manifest(self.store, v, None)
                if m.kind == "anchor":
                    self.anchor_writes = len(m.objects) + len(m.extra_files) + 2
                    break

    def _anchor_of(self, v: int | None) -> int | None:
        if v is None:
            return None
        return read_manifest(self.store, v, None).anchor_version

    def _phase(self, v: int, latest: int | None) -> str:
        if latest == v:
            head = self._head("phase")
            return "committed, HEAD moved" if head == v else "committed, HEAD not yet moved"
        prefix = f"{v:012d}-"
        data = [k for k in self.store.list_prefix("anchors/") + self.store.list_prefix("deltas/")
                if k.split("/")[1].startswith(prefix)]
        if data:
            return "data uploaded, not committed"
        if self._local_temps(v):
            return "data being written, not committed"
        return "before any upload"

    def _local_temps(self, v: int | None = None) -> list[str]:
        if self.store.backend != "local":
            return []
        out = []
        for d, _dirs, files in os.walk(self.store.root):
            for f in files:
                rel = os.path.relpath(os.path.join(d, f), self.store.root)
                if rel in (RUN_KEY, HEAD_KEY) or rel.startswith("manifests/"):
                    continue
                parts = rel.split(os.sep)
                # a temp file at the root is HEAD's or RUN.json's write (HEAD moves after publish() returns, so a
                # kill lands there too): no version's data
                if v is None or (len(parts) > 1 and parts[1].startswith(f"{v:012d}-")):
                    out.append(rel)
        return out

    def _head(self, where: str) -> int | None:
        try:
            return Head.from_json(self.store.get(HEAD_KEY)).version
        except ObjectNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            self.fig.violations.append(f"{where}: HEAD unreadable: {type(e).__name__}: {e}")
            return None

    def _check_immutable(self, vs: list[int], where: str) -> None:
        for v in vs:
            h = _xxh(self.store.get(manifest_key(v)))
            if self.manifest_xxh3.setdefault(v, h) != h:
                self.fig.violations.append(f"{where}: manifest of version {v} was rewritten")
        for v in set(self.manifest_xxh3) - set(vs):
            self.fig.violations.append(f"{where}: manifest of version {v} disappeared without gc")
            del self.manifest_xxh3[v]
        try:
            run_json = self.store.get(RUN_KEY)
        except ObjectNotFoundError:
            return
        if self.run_json is None:
            self.run_json = run_json
        elif run_json != self.run_json:
            self.fig.violations.append(f"{where}: RUN.json was rewritten")

    def _check_exact(self, reader: SnapshotReader, v: int, where: str) -> None:
        got = reader.read_tensors(v)
        want = weights_for(self.seed, v)
        bad = sorted(set(got) ^ set(want)) + [n for n in want if n in got and not _same_bits(got[n], want[n])]
        if bad:
            self.fig.violations.append(f"{where}: snapshot {v} differs from the ground truth in {bad[:5]}")
        self.fig.snapshots_checked += 1

    def _gc_and_check(self, where: str, *, read_kept: bool = True) -> None:
        fig = self.fig
        report = collect(self.url, keep_anchors=2, storage_options=self.opts, grace_seconds=0)
        fig.gc_deleted_objects += len(report.deleted_objects)
        fig.gc_deleted_versions += len(report.deleted_versions)
        for v in report.deleted_versions:
            self.manifest_xxh3.pop(v, None)
        vs = committed_versions(self.store)
        referenced = set()
        for v in vs:
            m = read_manifest(self.store, v, None)
            referenced.update(o.key for o in m.objects + m.extra_files)
        data = set(self.store.list_prefix("anchors/") + self.store.list_prefix("deltas/"))
        if data - referenced:
            fig.violations.append(f"{where}: gc left {len(data - referenced)} unreferenced objects, "
                                  f"e.g. {sorted(data - referenced)[:3]}")
        if referenced - data:
            fig.violations.append(f"{where}: kept snapshots lost objects {sorted(referenced - data)[:3]}")
        stray = sorted(set(self._local_temps()) - referenced)
        if stray and stray != self.reported_stray:
            self.reported_stray = stray
            fig.violations.append(f"{where}: after gc, files no manifest references remain on disk: {stray[:3]}")
        if not read_kept:
            return
        reader = SnapshotReader(self.url, storage_options=self.opts)
        for v in vs:
            try:
                self._check_exact(reader, v, where)
            except Exception as e:  # noqa: BLE001
                fig.violations.append(f"{where}: kept snapshot {v} unreadable after gc: {type(e).__name__}: {e}")

    def finish(self) -> None:
        """A last publisher, never killed, continues the run: two more versions, every check."""
        last, _ = self._state()
        self.zygote.spawn(url=self.url, storage_options=self.opts, seed=self.seed, n_publish=2, kill=None)
        events = []
        while True:
            ev = self.zygote.next_event(300)
            if ev is None:
                self.zygote.kill_child()
                self.fig.violations.append("final publisher hung")
                continue
            events.append(ev)
            if ev["ev"] == "EXITED":
                break
        self.zygote.reap()
        if events[-1]["code"] != 0:
            self.fig.violations.append(f"final publisher did not finish: {events[-3:]}")
        self._check(last, events, "none", False)


def run_campaign(url: str, opts: dict, tmp_path, *, kills: int, label: str, read_kept_every: int = 1) -> Figures:
    zygote = Zygote(str(tmp_path / "zygote.log"))
    t0 = time.monotonic()
    try:
        c = Campaign(url, opts, zygote, label, read_kept_every=read_kept_every)
        while c.fig.kills < kills and c.fig.trials < 3 * kills:
            c.trial()
        c.finish()
    finally:
        zygote.close()
    print()
    print(c.fig.report())
    print(f"  wall time {time.monotonic() - t0:.1f}s")
    return c.fig


def _assert_campaign(fig: Figures, kills: int) -> None:
    assert fig.violations == [], fig.report()
    assert fig.kills >= kills, fig.report()
    kinds = {k for (k, _p) in fig.kills_by}
    assert {"anchor", "delta"} <= kinds, fig.report()


def test_gc_removes_the_temp_file_of_a_local_write_killed_midway(tmp_path):
    """Regression: a writer SIGKILLed inside a local write leaves its temp file, which listings hide;
    gc used to list only visible keys and never removed it."""
    url = str(tmp_path / "run")
    store = Store.from_url(url)
    store.put("anchors/000000000003-dead/model.safetensors", b"x" * 10)   # debris gc always saw
    pid = os.fork()
    if pid == 0:  # the child dies half-way through writing a shard
        try:
            def half_then_die(f):
                f.write(b"y" * 4096)
                f.flush()
                os.kill(os.getpid(), 9)
            store._local_write(os.path.join(store.root, "anchors/000000000003-dead/model-2.safetensors"),
                               half_then_die, create_only=False)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    temps = [k for k in store.list_prefix("", include_temp=True) if "/.ckptdelta-tmp-" in k]
    assert len(temps) == 1 and store.list_prefix("anchors/") == ["anchors/000000000003-dead/model.safetensors"]

    young = collect(url)                          # within the grace period: could be a live write
    assert set(young.young_orphans) == set(temps) | {"anchors/000000000003-dead/model.safetensors"}
    report = collect(url, grace_seconds=0)
    assert set(temps) <= set(report.deleted_objects)
    assert store.list_prefix("", include_temp=True) == []


def test_publisher_killed_at_random_moments_leaves_a_readable_unrewritten_run_local(tmp_path):
    fig = run_campaign(str(tmp_path / "run"), {}, tmp_path, kills=10, label="local, fast")
    _assert_campaign(fig, 10)


@pytest.mark.slow
def test_publisher_killed_50_times_leaves_a_readable_unrewritten_run_local(tmp_path):
    fig = run_campaign(str(tmp_path / "run"), {}, tmp_path, kills=60, label="local")
    _assert_campaign(fig, 60)
    assert sum(n for (k, _p), n in fig.kills_by.items() if k == "anchor") >= 20
    assert sum(n for (k, _p), n in fig.kills_by.items() if k == "delta") >= 20


@pytest.mark.slow
def test_publisher_killed_50_times_leaves_a_readable_unrewritten_run_s3(tmp_path, s3_root):
    url, opts = s3_root
    fig = run_campaign(url, opts, tmp_path, kills=50, label="s3 (moto)", read_kept_every=2)
    _assert_campaign(fig, 50)
    assert sum(n for (k, _p), n in fig.kills_by.items() if k == "anchor") >= 20
    assert sum(n for (k, _p), n in fig.kills_by.items() if k == "delta") >= 20


def test_a_publisher_killed_mid_publish_leaves_temp_dirs_the_next_publisher_removes_and_a_live_ones_stay(tmp_path):
    """A trainer killed while it writes an anchor or a delta (SIGKILL: no cleanup runs) leaves its temporary
    directory behind; the next Publisher on the host removes it, while a directory whose publish still runs
    (locked by a live process) and one that is not a publisher's own (no lock file) stay."""
    import subprocess
    import sys
    import tempfile

    from ckptdelta.publisher import tempdirs

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.getcwd())
    child = ("import os, sys\n"
             "from ckptdelta.publisher.tempdirs import locked_tempdir\n"
             "with locked_tempdir(sys.argv[1]) as d:\n"
             "    open(os.path.join(d, 'shard'), 'wb').write(b'x' * 4096)\n"
             "    print(d, flush=True)\n"
             "    os.kill(os.getpid(), 9)\n")
    dead = []
    for kind in tempdirs.KINDS:
        p = subprocess.run([sys.executable, "-c", child, kind], env=env, capture_output=True, text=True)
        assert p.returncode == -9, p.stderr
        dead.append(p.stdout.strip())
    foreign = tmp / "ckptdelta-delta-not-ours"
    foreign.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(tmp))
        with tempdirs.locked_tempdir("anchor") as live:
            assert all(os.path.isdir(d) for d in dead)
            Publisher(str(tmp_path / "run")).close()       # a new publisher sweeps at start
            assert not any(os.path.exists(d) for d in dead)
            assert os.path.isdir(live) and foreign.is_dir()
        assert not os.path.exists(live)
