"""What every benchmark shares, so that each keeps only its run and its table.

- **Results**: :func:`write` puts a run's ``<stem>.md`` (printed too), ``<stem>.json`` and
  ``<stem>.png`` under benchmarks/results/ (:data:`RESULTS`) or the run's ``--out-dir``;
  :func:`figure` draws the PNG headless. A table is rendered from the JSON alone, so
  ``--from-json`` (:func:`read_json`) writes the table and the plot of an earlier run again.
- **The command line**: :func:`parser` is ``python -m benchmarks.NAME``'s, with the flags the
  benchmarks share where a benchmark asks for them (``--quick``, the output folder,
  ``--from-json``, the S3 bucket); :func:`command` is the line a table quotes.
- **Units**: the formatters of the tables' cells (:func:`ms`, :func:`seconds`, :func:`duration`,
  :func:`mb`, :func:`nbytes`, :func:`bitrate`, :func:`value`) and :func:`parse_bitrate` for link flags.
- **The peer process**: a trainer or a replica as a child process (in a network namespace of
  benchmarks.links, or not) driven by one JSON line each way: :class:`Peer` is the caller's end,
  :func:`serve` the peer's.
- **Small pieces**: :func:`machine` (a table's first words), :func:`medians` and
  :func:`median_sample` (repeated samples), :class:`Clients` (a load of client threads),
  :func:`backend` (an empty bucket for a run), :func:`tail` and :func:`du`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

#: Where a benchmark's files go unless its output flag says otherwise (tracked: the runs of record).
RESULTS = os.path.join(os.path.dirname(__file__), "results")
#: The repository root: peer processes start there, so ``-m benchmarks.*`` imports this tree's code.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- results ------------------------------------------------------------------------------------------

def write(stem: str, markdown: str | None = None, data: Any = None, plot: Callable[[str], None] | None = None,
          *, echo: bool = True) -> None:
    """A run's results: ``<stem>.md``, ``<stem>.json`` and ``<stem>.png``, each only where given (``plot``
    draws the PNG at the path it is handed), the folder made first. With ``echo`` the markdown is also the
    run's last output, after a blank line that sets it off from the progress lines before it."""
    if markdown is not None and echo:
        print()
        print(markdown)
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    if markdown is not None:
        with open(stem + ".md", "w") as f:
            f.write(markdown)
    if data is not None:
        with open(stem + ".json", "w") as f:
            json.dump(data, f, indent=1)
    if plot is not None:
        plot(stem + ".png")


def read_json(path: str) -> Any:
    """An earlier run's JSON, for ``--from-json``: its table and plot are rendered from it alone."""
    with open(path) as f:
        return json.load(f)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: benchmarks draw files, on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(path: str, *args: Any, dpi: int = 100, **kw: Any) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` of ``plt.subplots(*args, **kw)``, saved to ``path`` at ``dpi`` after a tight layout
    when the block ends; the figure is closed either way (a plot that fails leaves no half-drawn file and
    holds no memory)."""
    plt = pyplot()
    fig, axes = plt.subplots(*args, **kw)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


# --- the command line ---------------------------------------------------------------------------------

def parser(name: str, doc: str, *, full_doc: bool = False, quick: str | None = None,
           out: str | None = "--out-dir", from_json: str | None = None, from_json_flag: str = "--from-json",
           from_json_metavar: str = "PATH", s3: bool = False) -> argparse.ArgumentParser:
    """``python -m benchmarks.<name>``'s parser: its description the first paragraph of ``doc`` (all of it,
    as written, with ``full_doc``), and the flags the benchmarks share, each where it is asked for:
    ``--quick`` (its help ``quick``: what the smoke run leaves out), the output folder (flag ``out``, default
    :data:`RESULTS`; None: none), a re-render of an earlier run's JSON (flag ``from_json_flag``, help
    ``from_json``), and with ``s3`` a bucket of the user's (``--s3-url``, ``--storage-options``) in place of
    the local S3 server (:func:`backend`)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}",
                                description=doc if full_doc else doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter if full_doc else
                                argparse.HelpFormatter)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if out is not None:
        p.add_argument(out, default=RESULTS, metavar="DIR",
                       help="where the .md, .json and .png go (default benchmarks/results/)")
    if from_json is not None:
        p.add_argument(from_json_flag, metavar=from_json_metavar, help=from_json)
    if s3:
        p.add_argument("--s3-url", default=None, help="an s3:// prefix to run against instead of a local moto server")
        p.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON")
    return p


def measured_argv(argv: list[str]) -> list[str]:
    """A run's arguments less where its files went (``--out-dir DIR``, a path of the machine that ran it), which
    says nothing about what was measured: what a result records."""
    argv = list(argv)
    if "--out-dir" in argv:
        i = argv.index("--out-dir")
        del argv[i:i + 2]
    return [x for x in argv if not x.startswith("--out-dir=")]


def command(name: str, argv: list[str]) -> str:
    """The command line of a run as a table quotes it: ``python -m benchmarks.<name>`` and its arguments."""
    return " ".join([f"python -m benchmarks.{name}", *measured_argv(argv)])


# --- units --------------------------------------------------------------------------------------------

def ms(seconds: float, digits: int = 1) -> str:
    """Milliseconds, the number alone (the column names the unit): 0.01234 -> '12.3'."""
    return f"{1000 * seconds:.{digits}f}"


def seconds(x: float) -> str:
    """Seconds to two decimals, the number alone (the column says seconds), from 0.1 s up; below, whole
    milliseconds marked as such: 1.234 -> '1.23', 0.045 -> '45 ms'."""
    return f"{x:.2f}" if x >= 0.1 else f"{x * 1000:.0f} ms"


def duration(x: float) -> str:
    """Seconds with the unit that reads best, from microseconds to seconds: '45 us', '4.5 ms', '45 ms',
    '1.23 s'."""
    if x < 0.001:
        return f"{x * 1e6:.0f} us"
    return f"{x * 1e3:.1f} ms" if x < 0.01 else f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def mb(n: float, digits: int | None = None) -> str:
    """Megabytes (1e6 bytes), the number alone, to ``digits`` decimals; by default one from 0.1 MB up and
    three below, so a small delta does not show as 0.0."""
    if digits is None:
        digits = 1 if n >= 1e5 else 3
    return f"{n / 1e6:.{digits}f}"


def nbytes(n: float) -> str:
    """Bytes with the decimal unit that reads best: '512 B', '1.5 KB', '12.0 MB', '3.2 GB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def bitrate(bit: float) -> str:
    """A link's rate: 1e9 -> '1 Gbit/s', 1e7 -> '10 Mbit/s'."""
    return f"{bit / 1e9:g} Gbit/s" if bit >= 1e9 else f"{bit / 1e6:g} Mbit/s"


def parse_bitrate(s: str) -> float | None:
    """A link flag's setting in bit/s: '1gbit' -> 1e9, '500mbit' -> 5e8, 'fast' -> None (unshaped). Usable as
    an argparse ``type``: a setting it cannot read is the flag's error."""
    if s == "fast":
        return None
    m = re.fullmatch(r"([0-9.]+)(k|m|g)bit", s.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"link {s!r}: expected e.g. 1gbit, 500mbit or fast")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def value(x: float | None, unit: str, digits: int = 3) -> str:
    """A measured value with its unit, or '-' where it was not measured: (0.1234, 's') -> '0.123 s'."""
    return "-" if x is None else f"{x:.{digits}f} {unit}"


# --- the peer process ---------------------------------------------------------------------------------

class Peer:
    """A benchmark's trainer or replica as a child process, started in the repository (so ``argv`` = ``python
    -m benchmarks.<peers module> ...`` runs this tree's code): in ``host``'s network namespace of ``lab``
    (benchmarks.links, which ends it with the lab), or as a plain child in a session of its own. It reads one
    JSON command per line on stdin and answers each with one JSON line on stdout (:func:`serve`); its stderr
    is its log, whose tail a failure quotes. ``name`` names it in errors; ``timeout`` is how long an answer
    may take unless a call says otherwise."""

    def __init__(self, name: str, argv: list[str], log_path: str, *, lab: Any = None, host: Any = None,
                 env: dict[str, str] | None = None, timeout: float = 900.0) -> None:
        self.name, self.log_path, self.timeout = name, log_path, timeout
        self._pending = b""      # what the peer wrote after the last answer's line
        kw: dict[str, Any] = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
                                  env={**os.environ, **env} if env else None)
        with open(log_path, "wb") as log:
            if lab is not None:
                self.proc = lab.popen(host, argv, stderr=log, **kw)
            else:
                self.proc = subprocess.Popen(argv, stderr=log, start_new_session=True, **kw)

    def send(self, op: str, **kw: Any) -> None:
        """Send a command without waiting for its answer (several peers can then work at once)."""
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        """The next answer; an error the peer raised, its exit or silence past ``timeout`` is a RuntimeError
        naming the peer, with its trace or its log's tail. Answers come in the order of the commands, also
        for several sent ahead: the lines are split here, from what the pipe holds (a buffered reader could
        hold a second answer where ``select`` does not see it)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 1 << 20) if ready else b""
            if not chunk:
                raise RuntimeError(f"{self.name}: no answer ({'exited' if self.proc.poll() is not None else 'timeout'}"
                                   f"); log tail:\n{tail(self.log_path)}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        r = json.loads(line)
        if not r.pop("ok"):
            raise RuntimeError(f"{self.name}: {r['error']}\n{r['trace']}")
        return r

    def call(self, op: str, *, timeout: float | None = None, **kw: Any) -> dict[str, Any]:
        """``op`` with ``kw`` on the peer (its ``op_<op>(**kw)``), and its answer."""
        self.send(op, **kw)
        return self.recv(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Ask the peer to exit (it drops what it holds first); one that does not within ``timeout`` is killed."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)


def serve(node: Any, hello: dict[str, Any] | None = None) -> int:
    """The peer's end of :class:`Peer` on stdin/stdout: one JSON command per line (``{"op": name, ...}`` calls
    ``node.op_<name>(...)``), one JSON answer per line (``ok`` and what the op returned, or ``ok: false`` with
    the error and its trace), until ``exit``; then ``node.op_drop()``. ``hello``, when given, is the first
    line: the caller then knows the peer is up before it sends anything."""
    out = sys.stdout
    sys.stdout = sys.stderr   # anything printed by libraries goes to the log, not the protocol
    if hello is not None:
        out.write(json.dumps(hello) + "\n")
        out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            reply = {"ok": True, **getattr(node, f"op_{op}")(**cmd)}
        except Exception as e:  # noqa: BLE001 - the caller reports it
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    node.op_drop()
    return 0


# --- small pieces -------------------------------------------------------------------------------------

def machine(*notes: str) -> str:
    """The machine a run measured, as a table's first words: architecture, CPUs, ``notes``, torch's version."""
    import torch

    return ", ".join([platform.machine(), f"{os.cpu_count()} CPUs", *notes, f"torch {torch.__version__}"])


def medians(samples: Iterable[dict[str, Any]], keys: Iterable[str]) -> dict[str, float]:
    """The median of each of ``keys`` over ``samples`` (a shared machine is noisy: medians, not means)."""
    samples = list(samples)
    return {k: statistics.median(s[k] for s in samples) for k in keys}


def median_sample(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated samples of one step as one row: per field the median of numbers, all() of flags, the first
    sample's value of anything else; the samples kept under ``samples``."""
    out: dict[str, Any] = {}
    for k, v in samples[0].items():
        vals = [s[k] for s in samples]
        if isinstance(v, bool):
            out[k] = all(vals)
        elif isinstance(v, (int, float)):
            out[k] = statistics.median(vals)
        else:
            out[k] = v
    out["samples"] = samples
    return out


class Clients:
    """``clients`` daemon threads, each running ``self._loop(i)`` until :meth:`stop`: a load of clients beside
    what a benchmark measures (a subclass's ``_loop`` checks ``self._stop`` between its requests)."""

    #: How long :meth:`stop` waits for each thread's request in flight.
    stop_timeout = 600.0

    def __init__(self, clients: int) -> None:
        self.clients = clients
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"load-{i}")
                         for i in range(clients)]

    def _loop(self, i: int) -> None:
        raise NotImplementedError

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop the load; each thread ends after its request in flight (``stop_timeout`` each, at most)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.stop_timeout)


@contextmanager
def backend(kind: str, s3_url: str | None, storage_options: dict | None) -> Iterator[tuple[str, dict | None]]:
    """(root URL, storage options) of an empty place for a run's buckets, removed afterwards: a temporary
    directory (``local``), or for ``s3`` a fresh prefix of ``s3_url`` (the user's bucket, ``storage_options``)
    or, without one, a bucket of a moto server started here on 127.0.0.1 (tests/servers.py)."""
    if kind == "local":
        d = tempfile.mkdtemp(prefix="ckptdelta-latency-")
        try:
            yield d, None
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    if kind != "s3":
        raise ValueError(f"backend {kind!r}: expected local or s3")
    import fsspec

    if s3_url:  # a real bucket: a fresh prefix in it
        root = f"{s3_url.rstrip('/')}/latency-{uuid.uuid4().hex[:8]}"
        try:
            yield root, storage_options
        finally:
            fsspec.filesystem("s3", **(storage_options or {})).rm(root, recursive=True)
        return
    from tests.servers import S3_TEST_CREDENTIALS, start_moto_server

    server = start_moto_server()
    try:
        opts = {**S3_TEST_CREDENTIALS, "client_kwargs": {"endpoint_url": server.endpoint}}
        bucket = f"latency-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("s3", skip_instance_cache=True, **opts).mkdir(bucket)
        yield f"s3://{bucket}", opts
    finally:
        server.stop()


def tail(path: str, n: int = 3000) -> str:
    """The last ``n`` bytes of a log, as text ('' when it cannot be read): what a failure quotes."""
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


def du(path: str) -> int:
    """Bytes of the files under ``path`` (one removed meanwhile counts nothing): what a bucket's prefix holds
    on a disk-backed server."""
    total = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total
