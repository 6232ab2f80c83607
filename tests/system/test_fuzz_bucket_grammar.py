"""Grammar-aware fuzzing of everything a reader takes from a bucket (issue 29), and the defects it found.

tests/system/test_fuzz_entry_points.py damages bytes; a digest stops nearly every such damage before any parser
sees it. Here tests/bucket_grammar.py rewrites one object the way a writer of the bucket could -- hostile
in meaning, well formed in shape -- and reseals it (sizes and digests in the manifests, the manifest's
digest in HEAD), so the structure reaches the parser: manifests, shard safetensors headers, delta record
headers and payloads, delta object footers, HEAD, RUN.json, the shard index and the extra files' names. Each
case goes through every entry point that reads a bucket, on a real local run published by the Publisher:

* ``SnapshotReader.read_tensors``, ``.verify``, ``.materialize``; ``HotSwapper.prepare`` + ``commit`` (from
  version 0 and as an initial load);
* ``ckptdelta ls`` / ``verify`` (of the target, and of 'latest' where HEAD or a manifest changed) /
  ``materialize`` / ``inspect`` / ``gc --dry-run`` through ``ckptdelta.cli.main``.

Each either succeeds -- with exactly the tensors the bucket's manifest claims (names, dtypes, shapes, digests
of the bits), and when ``verify`` passes, with exactly the published bits -- or raises a ``CkptDeltaError``
naming the object or snapshot (the CLI exits 1 with one line). Never another exception, and never an
allocation past the stated bound: the tracemalloc peak of a case stays under ``PARSE_MEMORY_FACTOR`` times
the largest object in the bucket plus a constant (docs/FORMAT.md, "Bounds a reader enforces"), and no case
raises the RSS high-water mark by more than RSS_GROWTH plus tracemalloc's own share (torch's allocator is
invisible to tracemalloc).

``make test`` runs a fixed seed and ``CKPTDELTA_GRAMMAR_EXAMPLES`` examples per object kind (hypothesis,
derandomized); ``make stress`` runs many more (``@pytest.mark.slow``).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import struct
import subprocess
import sys
import time
import tracemalloc
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdelta.delta import digest, digest_hex, dtypes, untrusted_json
from ckptdelta.delta.errors import CkptDeltaError, ManifestError, PublishInputError
from ckptdelta.delta.manifest import HEAD_KEY, RUN_KEY, Manifest, RunInfo, manifest_key
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from tests import bucket_grammar as g
from tests.system.test_fuzz_entry_points import _cli, _names_object, _read_checkpoint, _weights
from tests import REPO

TARGET = 2
EXAMPLES = int(os.environ.get("CKPTDELTA_GRAMMAR_EXAMPLES", "6"))
SLOW_EXAMPLES = int(os.environ.get("CKPTDELTA_GRAMMAR_SLOW_EXAMPLES", "150"))
#: What a case may hold beyond PARSE_MEMORY_FACTOR x its largest object: the interpreter's and the libraries'
#: working set for this small run (measured on the pristine run: ~3 MiB).
BASE_BYTES = 24 << 20
#: How far one case may raise the RSS high-water mark: tracemalloc does not see torch's allocator, and a tensor
#: a header made torch allocate for real would be gigabytes. Per byte of the largest object: tracemalloc's own
#: record of every live block (a parsed manifest of 50,000 tensors raised it by ~680 MiB).
RSS_GROWTH = 512 << 20
RSS_PER_BYTE = 256
EXTRA = {"config.json": b'{"model_type": "fuzz"}', "tokenizer.json": b'{"version": "1.0"}', "tok/vocab.txt": b"a\nb\n"}
KINDS = ["manifest", "extra file names", "shard header", "record", "footer", "HEAD", "RUN.json", "shard index"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    url = str(root / "pristine")
    truth = {}
    with Publisher(url, anchor_every=10, shard_bytes=2048, extra_files=EXTRA, progress=False) as pub:
        for v in range(TARGET + 1):
            truth[v] = _weights(v)
            assert pub.publish(truth[v], 10 * v).version == v
    files = {}
    for d, _, names in os.walk(url):
        for f in names:
            path = os.path.join(d, f)
            files[os.path.relpath(path, url).replace(os.sep, "/")] = open(path, "rb").read()
    assert SnapshotReader(url).manifest(1).kind == "delta" and len([k for k in files if k.endswith("safetensors")]) > 1
    return {"root": root, "url": url, "truth": truth, "fp": _fingerprint(truth[TARGET]), "bucket": g.Bucket(files),
            "stats": Counter(), "peaks": {}, "slowest": {}, "rss0": _rss()}


def _fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """What a manifest claims of each tensor: its dtype's name, shape and the digest of its bits."""
    return {n: (dtypes.of(t).name, tuple(t.shape), digest_hex(digest(t))) for n, t in tensors.items()}


def _claims(bucket: g.Bucket) -> dict[str, tuple] | None:
    """What the target's manifest claims, or None if no reader could take it."""
    try:
        rid = RunInfo.from_json(bucket.files[RUN_KEY]).run_id
        m = Manifest.from_json(bucket.files[manifest_key(TARGET)], run_id=rid)
    except (CkptDeltaError, KeyError):
        return None
    return {n: (e.dtype, tuple(e.shape), e.xxh3) for n, e in m.tensors.items()}


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- one case through every entry point --------------------------------------------------------------------

class CaseCheck:
    def __init__(self, run, case: g.Case, url: str, scratch: str) -> None:
        self.run, self.case, self.url, self.scratch = run, case, url, scratch
        self.problems: list[str] = []
        self.claims = _claims(case.bucket)
        self.read: dict | None = None

    def call(self, entry: str, fn):
        """fn()'s result, or None after a CkptDeltaError naming the object; anything else is a problem."""
        try:
            out = fn()
        except CkptDeltaError as e:
            self.run["stats"][(self.case.kind, entry, "refused")] += 1
            if not _names_object(str(e), self.case.key, self.url):
                self.problems.append(f"{entry}: {type(e).__name__} names no object: {str(e)[:300]}")
            return None
        except Exception as e:  # noqa: BLE001 - every other class is what this test looks for
            self.problems.append(f"{entry}: {type(e).__name__}: {str(e)[:300]}")
            return None
        self.run["stats"][(self.case.kind, entry, "ok")] += 1
        return out if out is not None else True

    def claimed(self, entry: str, fp: dict) -> None:
        """A success returns exactly what the bucket's manifest claims (and the published bits, unless the
        case may have changed the snapshot's meaning)."""
        if fp != self.claims:
            diff = sorted(n for n in set(fp) | set(self.claims or {}) if fp.get(n) != (self.claims or {}).get(n))
            self.problems.append(f"{entry} returned other tensors than the manifest claims: {diff[:4]}")
        elif not self.case.meaning_may_change and fp != self.run["fp"]:
            self.problems.append(f"{entry} returned other tensors than were published")

    def cli(self, entry: str, argv: list[str]) -> int:
        try:
            rc, _out, err = _cli(argv)
        except BaseException as e:  # noqa: BLE001 - SystemExit from argparse included
            self.problems.append(f"cli {entry}: {type(e).__name__}: {str(e)[:300]}")
            return -1
        self.run["stats"][(self.case.kind, f"cli {entry}", f"rc={rc}")] += 1
        lines = err.strip().splitlines()
        if rc == 1:
            if len(lines) != 1 or "Traceback" in err:
                self.problems.append(f"cli {entry}: exit 1 without a one-line message: {err[:300]!r}")
            elif not _names_object(lines[0], self.case.key, self.url):
                self.problems.append(f"cli {entry}: message names no object: {lines[0][:300]}")
        elif rc != 0:
            self.problems.append(f"cli {entry}: exit status {rc}: {err[:300]!r}")
        return rc

    def run_all(self) -> None:
        url, truth = self.url, self.run["truth"]
        got = self.call("read_tensors", lambda: SnapshotReader(url).read_tensors(TARGET))
        if got is not None:
            self.read = _fingerprint(got)
            self.claimed("read_tensors", self.read)
        verified = self.call("verify", lambda: SnapshotReader(url).verify(TARGET)) is not None
        if verified and self.read != self.run["fp"]:
            self.problems.append("verify passed, but read_tensors did not return the published tensors")

        def materialize(out: str) -> None:
            SnapshotReader(url).materialize(TARGET, out, progress=False)
            self.claimed("materialize", _fingerprint(_read_checkpoint(out)))
        self.call("materialize", lambda: materialize(os.path.join(self.scratch, "m")))

        def hotload(version: int | None) -> None:
            live = {k: (t.clone() if version is not None else torch.zeros_like(t)) for k, t in truth[0].items()}
            sw = HotSwapper(live, SnapshotReader(url), version=version, progress=False)
            sw.commit(sw.prepare(TARGET, initial=version is None))
            self.claimed("hot-load", _fingerprint(live))
        self.call("hot-load from v0", lambda: hotload(0))
        self.call("initial hot-load", lambda: hotload(None))

        self.cli("ls", ["ls", url, "--json"])
        rc = self.cli("verify", ["verify", url, f"v{TARGET:08d}"])
        if (rc == 0) != verified:
            self.problems.append(f"cli verify exits {rc}, the API's verify {'passed' if verified else 'refused'}")
        out = os.path.join(self.scratch, "cli-m")
        if self.cli("materialize", ["materialize", url, str(TARGET), out, "--no-progress"]) == 0:
            self.claimed("cli materialize", _fingerprint(_read_checkpoint(out)))
        if self.case.kind in ("HEAD", "manifest", "RUN.json"):   # 'latest' reads HEAD and looks past it
            self.cli("verify latest", ["verify", url])
        self.cli("gc --dry-run", ["gc", url, "--dry-run", "--json"])
        if self.case.key.endswith(".ckd"):
            self.cli("inspect", ["inspect", os.path.join(url, self.case.key), "--json"])
        for leftover in os.listdir(self.scratch):    # a refused materialize leaves nothing behind
            if leftover.startswith("."):
                self.problems.append(f"materialize left {leftover} behind")


def check_case(run, case: g.Case) -> None:
    scratch = os.path.join(run["root"], "case")
    shutil.rmtree(scratch, ignore_errors=True)
    url = os.path.join(scratch, "run")
    case.bucket.write(url)
    largest = max(len(d) for d in case.bucket.files.values())
    ck = CaseCheck(run, case, url, scratch)
    t0, rss0 = time.perf_counter(), _rss()
    tracemalloc.start()
    try:
        ck.run_all()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    run["peaks"][case.kind] = max(run["peaks"].get(case.kind, 0), peak)
    run["slowest"][case.kind] = max(run["slowest"].get(case.kind, (0.0, "")), (time.perf_counter() - t0, str(case)))
    bound = untrusted_json.PARSE_MEMORY_FACTOR * largest + BASE_BYTES
    if peak > bound:
        ck.problems.append(f"tracemalloc peak {peak >> 20} MiB over the bound {bound >> 20} MiB "
                           f"(largest object {largest} bytes)")
    rss_bound = RSS_GROWTH + RSS_PER_BYTE * largest
    if _rss() - rss0 > rss_bound:
        ck.problems.append(f"RSS high-water mark rose by {(_rss() - rss0) >> 20} MiB (bound {rss_bound >> 20} MiB)")
    shutil.rmtree(scratch, ignore_errors=True)
    assert not ck.problems, f"{case}:\n  " + "\n  ".join(ck.problems)


def case_strategy(kind: str, bucket: g.Bucket, *, long: bool = False) -> st.SearchStrategy:
    if kind == "manifest":     # a manifest of 20,000 tensors takes a minute through every entry point under tracemalloc
        return g.manifest_cases(bucket, TARGET, most_tensors=20000 if long else 2000)
    if kind == "extra file names":
        return g.manifest_cases(bucket, TARGET, ops=("extra names",)).map(
            lambda c: g.Case("extra file names", c.key, c.what, c.bucket, c.meaning_may_change))
    if kind == "shard header":
        return g.shard_header_cases(bucket)
    if kind == "record":
        return g.record_cases(bucket)
    if kind == "footer":
        return g.footer_cases(bucket)
    key = {"HEAD": HEAD_KEY, "RUN.json": RUN_KEY}.get(kind) or g.index_key(bucket)
    return g.pointer_cases(bucket, key)


_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])


@pytest.mark.parametrize("kind", KINDS)
def test_every_entry_point_takes_hostile_grammar_exactly_or_refuses_it_within_bounds(run, kind):
    @settings(max_examples=EXAMPLES, **_SETTINGS)
    @given(data=st.data())
    def one(data):
        check_case(run, data.draw(case_strategy(kind, run["bucket"]), label="case"))
    one()
    _report(run, kind)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kind", KINDS)
def test_every_entry_point_takes_hostile_grammar_exactly_or_refuses_it_within_bounds_long(run, kind):
    @settings(max_examples=SLOW_EXAMPLES, **_SETTINGS)
    @given(data=st.data())
    def one(data):
        check_case(run, data.draw(case_strategy(kind, run["bucket"], long=True), label="case"))
    one()
    _report(run, kind)


def _report(run, kind: str) -> None:
    rows = sorted((e, o, c) for (k, e, o), c in run["stats"].items() if k == kind)
    slowest = run["slowest"].get(kind, (0.0, ""))
    print(f"\n{kind}: tracemalloc peak {run['peaks'].get(kind, 0) / 2**20:.1f} MiB; slowest case "
          f"{slowest[0]:.1f} s ({slowest[1][:120]}); RSS high-water mark +{(_rss() - run['rss0']) >> 20} MiB "
          "since the run was published; " + ", ".join(f"{e} {o} {c}" for e, o, c in rows))


# --- the defects the class came from, and the bounds, one by one --------------------------------------------

def _bucket_at(run, tmp_path, bucket: g.Bucket) -> str:
    url = str(tmp_path / "run")
    bucket.write(url)
    return url


def _one_line_refusal(argv: list[str], *needles: str) -> str:
    rc, _out, err = _cli(argv)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_verify_refuses_a_shard_header_nested_past_the_bound_with_a_ckptdelta_error(run, tmp_path):
    """Regression (issue 29): a shard whose safetensors header was deeply nested JSON, of the header's own
    length and resealed in its manifest, made verify raise RecursionError."""
    b = run["bucket"].copy()
    key = sorted(k for k in b.files if k.endswith(".safetensors"))[0]
    data = b.files[key]
    (n,) = struct.unpack_from("<Q", data, 0)
    depth = (n - 1) // 2
    b.put(key, data[:8] + (b"[" * depth + b"]" * depth).ljust(n) + data[8 + n:])
    b.reseal(key)
    url = _bucket_at(run, tmp_path, b)
    with pytest.raises(CkptDeltaError, match="nested deeper than") as ei:
        SnapshotReader(url).verify(TARGET)
    assert key in str(ei.value) and "v00000000" in str(ei.value)
    _one_line_refusal(["verify", url, str(TARGET)], key, "nested deeper than")
    assert _fingerprint(SnapshotReader(url).read_tensors(TARGET)) == run["fp"]    # reads never parse it


def test_json_nested_past_the_bound_is_refused_whatever_the_recursion_limit():
    """json.loads recurses once per level: under a raised recursion limit a deep document overflows the C stack
    (the interpreter dies with SIGSEGV). The depth is measured before the parse, so every reader refuses it."""
    code = ("import sys, struct, xxhash; sys.setrecursionlimit(10**6)\n"
            "from ckptdelta.delta.errors import CkptDeltaError\n"
            "from ckptdelta.delta.manifest import Manifest, Head\n"
            "from ckptdelta.delta.container import OBJECT_MAGIC, TRAILER, END_MAGIC, read_index\n"
            "deep = lambda n: b'[' * n + b']' * n\n"
            "footer = deep(300000)\n"
            "obj = OBJECT_MAGIC + footer + TRAILER.pack(len(footer), xxhash.xxh3_64_intdigest(footer), END_MAGIC)\n"
            "for parse in (lambda: Manifest.from_json(deep(300000)), lambda: Head.from_json(deep(30000)),\n"
            "              lambda: read_index(obj, len(obj))):\n"
            "    try:\n"
            "        parse()\n"
            "    except CkptDeltaError as e:\n"
            "        assert 'nested deeper than 16' in str(e), e\n"
            "print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "refused", (out.returncode, out.stderr[-2000:])


_TEXT = st.text(alphabet=st.sampled_from('ab"\\[]{}:,é\x00\n'), max_size=6)
_JSON = st.recursive(st.none() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(_TEXT, c, max_size=4), max_leaves=40)


def _depth(v: object) -> int:
    items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
    return 0 if items is None else 1 + max(map(_depth, items), default=0)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(doc=_JSON, ascii_only=st.booleans(), slice_bytes=st.integers(1, 64))
def test_the_depth_scan_finds_the_parsed_depth_of_any_document(doc, ascii_only, slice_bytes):
    """The scan that bounds the depth before the parse agrees with the parse, quotes, escaped quotes, brackets
    inside strings and slice boundaries included (slices of a few bytes here, 256 KiB in use)."""
    data = json.dumps(doc, ensure_ascii=ascii_only).encode()
    saved = untrusted_json._SCAN_BYTES
    untrusted_json._SCAN_BYTES = slice_bytes
    try:
        assert untrusted_json.nesting_depth(data) == _depth(doc)
    finally:
        untrusted_json._SCAN_BYTES = saved
    assert untrusted_json.loads(data, what="doc", max_bytes=1 << 20, max_depth=64) == doc


def test_parsing_json_from_a_bucket_holds_at_most_the_stated_memory_per_byte():
    """docs/FORMAT.md states PARSE_MEMORY_FACTOR bytes held per byte of a JSON object: checked on the documents
    CPython makes largest per byte (empty objects and lists, short strings, unique keys, floats), 1 MiB each."""
    n = 1 << 17
    docs = {"empty objects": b"[" + b"{}," * n + b"{}]", "empty lists": b"[" + b"[]," * n + b"[]]",
            "short strings": b"[" + b'"ab",' * n + b'"ab"]', "floats": b"[" + b"1.5," * n + b"1.5]",
            "unique keys": b"{" + b",".join(b'"%x":0' % i for i in range(n)) + b"}",
            "escapes": b'["' + b"\\u00e9" * n + b'"]', "quotes": b'["' + b'\\"' * n + b'"]'}
    for what, doc in docs.items():
        tracemalloc.start()
        try:
            untrusted_json.loads(doc, what=what, max_bytes=len(doc))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= untrusted_json.PARSE_MEMORY_FACTOR * len(doc) + (1 << 20), (what, peak / len(doc))


def test_extra_files_that_clash_as_a_file_and_a_directory_are_refused_naming_both(run, tmp_path):
    """Regression (issue 29): extra files 'config.json' and 'config.json/x' made materialize raise a bare
    FileExistsError. Every reader now refuses the manifest when it parses it, naming both keys, and
    materialize leaves nothing behind."""
    b = run["bucket"].copy()
    mk = manifest_key(TARGET)
    doc = b.doc(mk)
    first = doc["extra_files"][0]
    clash = {**first, "key": first["key"] + "/x"}
    doc["extra_files"].append(clash)
    b.put(mk, json.dumps(doc).encode())
    b.reseal_head(mk)
    url = _bucket_at(run, tmp_path, b)
    out = str(tmp_path / "out")
    for call in (lambda: SnapshotReader(url).materialize(TARGET, out, progress=False),
                 lambda: SnapshotReader(url).read_tensors(TARGET), lambda: SnapshotReader(url).verify(TARGET)):
        with pytest.raises(ManifestError, match="is both a file and the directory of") as ei:
            call()
        assert first["key"] in str(ei.value) and clash["key"] in str(ei.value), str(ei.value)
    _one_line_refusal(["materialize", url, str(TARGET), out, "--no-progress"], clash["key"])
    assert sorted(os.listdir(tmp_path)) == ["run"]          # no output, no temporary directory


def test_the_publisher_refuses_extra_files_that_clash_before_writing_anything(tmp_path):
    url = str(tmp_path / "run")
    for extra, words in (({"a": b"1", "a/b": b"2"}, "'a' is both a file and the directory of 'a/b'"),
                         ({"tok": b"1", "tok/vocab.txt": b"2", "config.json": b"{}"}, "'tok' is both")):
        with pytest.raises(PublishInputError, match=words):
            Publisher(url, extra_files=extra, progress=False)
    assert not os.path.exists(os.path.join(url, "manifests"))


def _modes(root: str) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.stat(path).st_mode)
    return out


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_materialize_makes_a_directory_that_follows_the_umask(run, tmp_path, umask):
    """Regression (issue 29): the checkpoint directory was 0700 under umask 022 (tempfile.mkdtemp), so a server
    running as another user could not read it. It is made like any directory now, still renamed into place
    whole: directories 0777 & ~umask, files 0666 & ~umask."""
    old = os.umask(umask)
    try:
        for out, how in ((str(tmp_path / "api"), "api"), (str(tmp_path / "cli"), "cli")):
            if how == "api":
                SnapshotReader(run["url"]).materialize(TARGET, out, progress=False)
            else:
                rc, _o, err = _cli(["materialize", run["url"], str(TARGET), out, "--no-progress"])
                assert rc == 0, err
            modes = _modes(out)
            assert "tok" in modes and "tok/vocab.txt" in modes and "model.safetensors" in modes
            for rel, mode in modes.items():
                want = (0o777 if os.path.isdir(os.path.join(out, rel)) else 0o666) & ~umask
                assert mode == want, f"{how} {rel}: {oct(mode)}, expected {oct(want)} under umask {oct(umask)}"
            assert _fingerprint(_read_checkpoint(out)) == run["fp"]
    finally:
        os.umask(old)


def test_a_materialize_refused_after_writing_shards_leaves_no_file_behind(run, tmp_path):
    """An extra file that fails its digest is read after the shards are written: nothing of the half-made
    checkpoint stays, neither the output directory nor its temporary one."""
    b = run["bucket"].copy()
    key = next(k for k in b.files if k.endswith("tok/vocab.txt"))
    b.files[key] = b"tampered"          # the manifests keep the old digest
    url = _bucket_at(run, tmp_path, b)
    out = str(tmp_path / "out")
    with pytest.raises(CkptDeltaError, match="vocab.txt"):
        SnapshotReader(url).materialize(TARGET, out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["run"]


_ABANDON = """
import gc, sys, threading
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.loader.update_path import rebuild_pieces
from ckptdelta.loader.verify import _chunks
reader = SnapshotReader(sys.argv[1])
chain = reader.chain(2)
groups = [rebuild_pieces(chain, n) for n in sorted(chain[-1].tensors)]
gens = [reader.iter_fetched(groups, batch_bytes=1), reader.iter_tensors(2),
        _chunks(reader, chain[0].objects[0])]
for g in gens:
    next(g)                             # its prefetch thread is running
gc.disable()
with threading._shutdown_locks_lock:    # what threading holds while it starts a thread, where gc may run
    del g
    gens.clear()                        # each generator finalized here, in this thread
print("closed")
"""


@pytest.mark.skipif(not hasattr(__import__("threading"), "_shutdown_locks_lock"), reason="CPython 3.9-3.12 only")
def test_an_abandoned_reading_generator_finalized_inside_threadings_lock_does_not_hang(run):
    """Found by the long fuzz run: a reader hung forever after a refused record. An abandoned iter_fetched (or
    iter_tensors, or verify's chunk reader) was closed by the garbage collector inside threading's own
    bookkeeping, which holds _shutdown_locks_lock; closing joined the prefetch thread, and the join takes that
    lock again. A generator being closed now shuts its executor down without joining."""
    out = subprocess.run([sys.executable, "-c", _ABANDON, run["url"]], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "closed", out.stderr[-2000:]
