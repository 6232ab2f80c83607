"""Seeded fuzzing of every entry point that reads a bucket: the class behind the errors (issue 14).

A small real run (v0 anchor in several shards with an index and config.json, v1
and v2 deltas; bf16 and float32 tensors, one unchanged across versions) is
published once with the real Publisher. Each case damages one stored object of
a fresh copy of the run's bytes — bit flips at random offsets inside a chosen
region (a shard's header or data, a record's header or payload, a delta
object's footer), truncations at random lengths, appended garbage, and for the
JSON objects (manifests, RUN.json, HEAD, the shard index, config.json)
JSON-level mutations: a field given another type, a huge or negative number,
an unknown field, a field removed — and then calls every entry point:

* ``SnapshotReader.read_tensors``, ``.verify``, ``.materialize``;
* ``HotSwapper.prepare`` (from version 0 and an initial load), then ``commit``;
* ``ckptdelta ls`` / ``verify`` / ``materialize`` / ``inspect`` through
  ``ckptdelta.cli.main``.

Each must either succeed with the exact bits (names, dtypes, shapes, bits) of
the version asked for — a damage in bytes no read depends on is harmless —
or raise a :class:`CkptDeltaError` whose message names the damaged object (or
the snapshot it belongs to); the CLI must exit 1 with one line on stderr. Any
other exception is a bug in the reading code. ``verify`` must refuse every
damage to a data object and to the manifest HEAD names.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
from collections import Counter

import pytest
import safetensors.torch
import torch

from ckptdelta.cli import main as cli_main
from ckptdelta.delta import digest
from ckptdelta.delta.errors import CkptDeltaError
from ckptdelta.delta.manifest import HEAD_KEY, RUN_KEY, manifest_key
from ckptdelta.delta.record import peek_header_size
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher

SEED = int(os.environ.get("CKPTDELTA_FUZZ_SEED", "14"))
CASES_PER_REGION = int(os.environ.get("CKPTDELTA_FUZZ_CASES", "6"))
TARGET = 2


def _weights(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    w = {
        "embed.weight": (torch.randn(48, 32, generator=g) * 0.02).bfloat16(),
        "layers.0.proj": (torch.randn(32, 32, generator=g) * 0.02).bfloat16(),
        "layers.0.norm": 1 + torch.randn(32, generator=g) * 0.05,
        "layers.0.frozen": (torch.randn(16, generator=g) * 0.02).bfloat16(),
        "head.weight": torch.randn(16, 32, generator=g) * 0.02,
    }
    for step in range(1, v + 1):
        gs = torch.Generator().manual_seed(SEED * 100 + step)
        for name, t in w.items():
            if name == "layers.0.frozen":
                continue
            ints = t.view(-1).view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)
            idx = torch.randint(0, ints.numel(), (max(1, ints.numel() // 20),), generator=gs)
            ints[idx] += torch.randint(1, 3, idx.shape, generator=gs).to(ints.dtype)
    return w


def _fingerprint(tensors: dict[str, torch.Tensor]) -> dict:
    return {n: (digest(t), str(t.dtype), tuple(t.shape)) for n, t in tensors.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    url = str(root / "pristine")
    truth = {}
    with Publisher(url, anchor_every=10, shard_bytes=2048, extra_files={"config.json": b'{"model_type": "fuzz"}'},
                   progress=False) as pub:
        for v in range(3):
            truth[v] = _weights(v)
            assert pub.publish(truth[v], 10 * v).version == v
    reader = SnapshotReader(url)
    assert reader.manifest(0).kind == "anchor" and reader.manifest(2).kind == "delta"
    inspect_out = {}
    for key in _keys(url):
        if key.endswith(".ckd"):
            inspect_out[key] = _inspect_rows(os.path.join(url, key))
    return {"root": root, "url": url, "truth": truth, "fp": _fingerprint(truth[TARGET]),
            "files": {k: open(os.path.join(url, k), "rb").read() for k in _keys(url)}, "inspect": inspect_out}


def _keys(url: str) -> list[str]:
    out = []
    for d, _, files in os.walk(url):
        for f in files:
            out.append(os.path.relpath(os.path.join(d, f), url).replace(os.sep, "/"))
    return sorted(out)


# --- regions and mutations ----------------------------------------------------------------------

def _regions(files: dict[str, bytes], url: str) -> list[tuple[str, str, int, int]]:
    """(kind, key, start, end) of every region a mutation may target."""
    reader = SnapshotReader(url)
    out = []
    for key, data in files.items():
        if key == HEAD_KEY:
            out.append(("HEAD", key, 0, len(data)))
        elif key == RUN_KEY:
            out.append(("RUN.json", key, 0, len(data)))
        elif key.startswith("manifests/"):
            out.append(("manifest", key, 0, len(data)))
        elif key.endswith(".safetensors"):
            (n,) = struct.unpack_from("<Q", data, 0)
            out.append(("shard header", key, 0, 8 + n))
            out.append(("shard data", key, 8 + n, len(data)))
        elif key.endswith(".index.json"):
            out.append(("shard index", key, 0, len(data)))
        elif key.endswith(".ckd"):
            records = []
            for v in reader.versions():
                m = reader.manifest(v)
                for e in m.tensors.values():
                    if e.object is not None and m.objects[e.object].key == key:
                        records.append((e.offset, e.length))
            for off, length in records:
                hs = peek_header_size(data[off:off + length])
                out.append(("record header", key, off, off + hs))
                if length > hs:
                    out.append(("record payload", key, off + hs, off + length))
            end = max(o + n for o, n in records)
            out.append(("delta footer", key, end, len(data)))
        else:
            out.append(("extra file", key, 0, len(data)))
    return out


JSON_KINDS = ("HEAD", "RUN.json", "manifest", "shard index", "extra file")
HUGE = [1 << 64, 1 << 62, 10 ** 30, -1, -(1 << 63), 1e308, float("inf"), 2 ** 53 + 1]
ODD = [None, True, "x", "", [], {}, [1, 2], {"a": 1}, 0, 1.5, "\udc80", "../../escape", "a" * 300]


def _json_nodes(doc, path=()):
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _json_nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _json_nodes(v, path + (i,))


def _json_mutation(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    doc = json.loads(data)
    nodes = list(_json_nodes(doc))
    path, node = rng.choice(nodes[1:] or nodes)
    op = rng.choice(["type", "huge", "unknown", "drop", "type", "huge"])
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    key = path[-1] if path else None
    if op == "unknown" or key is None:
        target = node if isinstance(node, dict) else doc
        target[f"zz_unknown_{rng.randrange(100)}"] = rng.choice(ODD + HUGE)
        desc = f"unknown field in {'/'.join(map(str, path))}"
    elif op == "drop":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
        desc = f"dropped {'/'.join(map(str, path))}"
    else:
        value = rng.choice(HUGE if op == "huge" else ODD)
        parent[key] = value
        desc = f"{'/'.join(map(str, path))} = {value!r}"[:120]
    return desc, json.dumps(doc).encode("utf-8", "surrogatepass")


def _mutations(kind: str, key: str, start: int, end: int, data: bytes, rng: random.Random, n: int):
    """(description, damaged bytes) for one region."""
    out = []
    for _ in range(n):
        pos, bit = rng.randrange(start, end), rng.randrange(8)
        b = bytearray(data)
        b[pos] ^= 1 << bit
        out.append((f"bit {bit} of byte {pos}", bytes(b)))
    for _ in range(max(1, n // 3)):
        cut = rng.randrange(start, end)
        out.append((f"truncated to {cut} bytes", data[:cut]))
    if start == 0:   # once per object: garbage after its end
        junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 64])))
        out.append((f"{len(junk)} garbage bytes appended", data + junk))
    if kind in JSON_KINDS:
        for _ in range(n):
            out.append(_json_mutation(data, rng))
    return out


# --- entry points --------------------------------------------------------------------------------

def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    return rc, out.getvalue(), err.getvalue()


def _inspect_rows(path: str):
    rc, out, err = _cli(["inspect", path, "--json"])
    assert rc == 0, err
    return json.loads(out)["tensors"]


def _read_checkpoint(d: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(safetensors.torch.load_file(os.path.join(d, f)))
    return out


def _names_object(msg: str, key: str, url: str = "") -> bool:
    """The message names the damaged object, another object of the run it led to (a key URL inside the run:
    a damaged manifest may name a key that does not exist), or the snapshot."""
    base = key.rsplit("/", 1)[-1]
    return (base in msg or (url and f"{url}/" in msg) or "manifests/" in msg or "anchors/" in msg or "deltas/" in msg
            or "HEAD" in msg or "RUN.json" in msg or "v0000000" in msg or "version " in msg)


class Checker:
    def __init__(self, run):
        self.run = run
        self.problems: list[str] = []
        self.outcomes: Counter = Counter()
        self.url = ""      # the damaged run's URL, set per case

    def call(self, entry: str, where: str, key: str, fn, *, must_fail: bool = False) -> None:
        try:
            fn()
        except CkptDeltaError as e:
            self.outcomes[(entry, "refused")] += 1
            if not _names_object(str(e), key, self.url):
                self.problems.append(f"{where}: {entry}: {type(e).__name__} names no object: {str(e)[:200]}")
        except Exception as e:  # noqa: BLE001 - every other class is the bug this test looks for
            self.problems.append(f"{where}: {entry}: {type(e).__name__}: {str(e)[:200]}")
        else:
            self.outcomes[(entry, "ok")] += 1
            if must_fail:
                self.problems.append(f"{where}: {entry} passed over the damage")

    def exact(self, entry: str, where: str, got: dict[str, torch.Tensor]) -> None:
        fp = _fingerprint(got)
        if fp != self.run["fp"]:
            wrong = sorted(n for n in set(fp) | set(self.run["fp"]) if fp.get(n) != self.run["fp"].get(n))
            raise AssertionError(f"{entry} returned other bits/names/dtypes/shapes for {wrong[:4]}")

    def cli(self, entry: str, where: str, key: str, argv: list[str], *, must_fail: bool = False) -> tuple[int, str]:
        try:
            rc, out, err = _cli(argv)
        except SystemExit as e:  # argparse only
            self.problems.append(f"{where}: {entry}: SystemExit {e.code}")
            return -1, ""
        except Exception as e:  # noqa: BLE001
            self.problems.append(f"{where}: {entry}: traceback {type(e).__name__}: {str(e)[:200]}")
            return -1, ""
        self.outcomes[(entry, f"rc={rc}")] += 1
        if rc == 1:
            lines = err.strip().splitlines()
            if len(lines) != 1 or "Traceback" in err:
                self.problems.append(f"{where}: {entry}: exit 1 without a one-line message: {err[:300]!r}")
            elif not _names_object(lines[0], key, self.url):
                self.problems.append(f"{where}: {entry}: message names no object: {lines[0][:200]}")
        elif rc != 0:
            self.problems.append(f"{where}: {entry}: exit status {rc}: {err[:200]!r}")
        elif must_fail:
            self.problems.append(f"{where}: {entry} exited 0 over the damage")
        return rc, out


def _check_case(ck: Checker, url: str, kind: str, key: str, where: str, scratch: str) -> None:
    run = ck.run
    ck.url = url
    data_object = kind not in ("HEAD", "RUN.json", "manifest")
    head_manifest = kind == "manifest" and key == manifest_key(TARGET)
    must_fail_verify = data_object or head_manifest

    ck.call("read_tensors", where, key, lambda: ck.exact("read_tensors", where,
                                                         SnapshotReader(url).read_tensors(TARGET)))
    ck.call("verify", where, key, lambda: SnapshotReader(url).verify(TARGET), must_fail=must_fail_verify)

    def materialize():
        out = os.path.join(scratch, "m")
        SnapshotReader(url).materialize(TARGET, out, progress=False)
        ck.exact("materialize", where, _read_checkpoint(out))
        with open(os.path.join(out, "config.json"), "rb") as f:
            if f.read() != run["files"][next(k for k in run["files"] if k.endswith("config.json"))]:
                raise AssertionError("materialize wrote another config.json")
    ck.call("materialize", where, key, materialize)

    def hotload(version):
        live = {k: (t.clone() if version is not None else torch.zeros_like(t)) for k, t in run["truth"][0].items()}
        sw = HotSwapper(live, SnapshotReader(url), version=version, progress=False)
        prepared = sw.prepare(TARGET, initial=version is None)
        sw.commit(prepared)
        ck.exact("hot-load", where, live)
    ck.call("hotswap.prepare(from v0)", where, key, lambda: hotload(0))
    ck.call("hotswap.prepare(initial)", where, key, lambda: hotload(None))

    rc, out = ck.cli("cli ls", where, key, ["ls", url, "--json"])
    if rc == 0 and kind not in ("manifest", "RUN.json"):   # those make rows unreadable, as they should
        rows = json.loads(out)
        if [r["version"] for r in rows] != [0, 1, 2] or any("error" in r for r in rows):
            ck.problems.append(f"{where}: cli ls lists {rows}")
    ck.cli("cli verify", where, key, ["verify", url, f"v{TARGET:08d}"], must_fail=must_fail_verify)
    out_dir = os.path.join(scratch, "cli-m")
    rc, _ = ck.cli("cli materialize", where, key, ["materialize", url, str(TARGET), out_dir, "--no-progress"])
    if rc == 0:
        try:
            ck.exact("cli materialize", where, _read_checkpoint(out_dir))
        except AssertionError as e:
            ck.problems.append(f"{where}: {e}")
    if key.endswith(".ckd"):
        rc, out = ck.cli("cli inspect", where, key, ["inspect", os.path.join(url, key), "--json"])
        if rc == 0 and json.loads(out)["tensors"] != run["inspect"][key]:
            ck.problems.append(f"{where}: inspect describes other tensors than the pristine object's")


def test_every_entry_point_refuses_fuzzed_bucket_bytes_with_a_ckptdelta_error_naming_the_object(run):
    rng = random.Random(SEED)
    ck = Checker(run)
    files = run["files"]
    per_kind: Counter = Counter()
    n_cases = 0
    for i, (kind, key, start, end) in enumerate(_regions(files, run["url"])):
        n = CASES_PER_REGION if kind not in ("record header", "record payload") else max(1, CASES_PER_REGION // 3)
        for what, damaged in _mutations(kind, key, start, end, files[key], rng, n):
            if damaged == files[key]:
                continue
            n_cases += 1
            per_kind[kind] += 1
            case_dir = os.path.join(run["root"], f"case-{n_cases}")
            url = os.path.join(case_dir, "run")
            shutil.copytree(run["url"], url)         # a fresh copy of the run for each case
            with open(os.path.join(url, key), "wb") as f:
                f.write(damaged)
            _check_case(ck, url, kind, key, f"{kind} {key} ({what})", case_dir)
            shutil.rmtree(case_dir)
    print(f"\nfuzzed entry points: {n_cases} cases, seed {SEED}, per kind {dict(sorted(per_kind.items()))}")
    for (entry, outcome), c in sorted(ck.outcomes.items()):
        print(f"  {entry:<28} {outcome:<8} {c}")
    assert n_cases >= 200
    assert not ck.problems, f"{len(ck.problems)} problems:\n" + "\n".join(ck.problems[:60])


# --- regressions of what the fuzzing found ---------------------------------------------------------

def _copy_with(run, tmp_path, key: str, data: bytes) -> str:
    url = str(tmp_path / "run")
    shutil.copytree(run["url"], url)
    with open(os.path.join(url, key), "wb") as f:
        f.write(data)
    return url


def test_a_parent_mismatch_found_while_hot_loading_names_the_record_and_snapshot(run, tmp_path):
    """Regression: a flipped bit renamed 'head.weight' in v1's manifest, so v2's record (encoded against v1's
    tensor) became the first piece of the forward route from v0; the codec's ParentMismatchError named only
    the tensor. Errors from decoding or applying a parsed record now name its object, range and snapshot."""
    key = manifest_key(1)
    data = run["files"][key]
    assert data.count(b'"head.weight"') == 1
    url = _copy_with(run, tmp_path, key, data.replace(b'"head.weight"', b'"head.weigxt"'))
    live = {k: t.clone() for k, t in run["truth"][0].items()}
    with pytest.raises(CkptDeltaError) as ei:
        HotSwapper(live, SnapshotReader(url), version=0, progress=False).prepare(TARGET)
    assert "deltas/" in str(ei.value) and "v00000002" in str(ei.value), str(ei.value)
    assert _fingerprint(live) == _fingerprint(run["truth"][0])


def test_an_object_a_manifest_names_but_the_store_lacks_is_reported_with_the_entry_that_wants_it(run, tmp_path):
    """Regression: a manifest whose object key was damaged into another valid key ('1') failed reads with
    'get .../run/1: no such object', verify with 'info .../1: ...': neither said which snapshot or tensor."""
    key = manifest_key(1)      # not the one HEAD names: verify would refuse it by HEAD's digest first
    doc = json.loads(run["files"][key])
    doc["objects"][0]["key"] = "deltas/missing.ckd"
    url = _copy_with(run, tmp_path, key, json.dumps(doc).encode())
    for call in (lambda: SnapshotReader(url).read_tensors(TARGET), lambda: SnapshotReader(url).verify(TARGET)):
        with pytest.raises(CkptDeltaError, match="v00000001") as ei:
            call()
        assert "deltas/missing.ckd" in str(ei.value)
    rc, _, err = _cli(["verify", url, str(TARGET)])
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "deltas/missing.ckd" in err


def test_inspect_of_a_path_that_is_not_a_readable_file_exits_1_with_one_line(tmp_path):
    """Regression: ``ckptdelta inspect`` of a missing file or a directory ended in a traceback."""
    for path in (str(tmp_path / "missing.ckd"), str(tmp_path)):
        rc, _, err = _cli(["inspect", path])
        assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert os.path.basename(path) in err
