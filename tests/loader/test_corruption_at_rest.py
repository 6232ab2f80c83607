"""Corruption at rest: flipped bits and truncations in every kind of stored object are caught.

Three levels, one rule: a corrupt byte in the bucket either costs an error
that names what is corrupt, or changes nothing (a byte no read depends on);
never a wrong bit in the weights handed out.

* every object of a run written by the real Publisher (anchor shards, their
  index and extra files, delta objects, manifests, HEAD, RUN.json) gets
  single-bit flips at random positions and truncations: ``read_tensors`` raises
  a ckptdelta error or returns the exact weights, and ``verify`` catches every
  change to a data object (and to the manifest HEAD names);
* a HotSwapper over a live state dict refuses each corrupt update in
  ``prepare`` and the live weights stay the old version's bits;
* a live replica (the real server, tiny LM) answers each corrupt hot-load
  with FAILED (or a refusal) and a reason naming the object, and keeps serving
  the version it had, bit-exact.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from ckptdelta.delta import digest
from ckptdelta.delta.errors import CkptDeltaError
from ckptdelta.delta.manifest import HEAD_KEY, RUN_KEY, Manifest, manifest_key
from ckptdelta.loader.engines.reference.model import load_engine
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from tests.crashers.publish_loop import CONFIG, SHARD_BYTES, weights_for
from tests.lm import rl_step
from tests.replicas import Replica, lm_dir, publish_run, state_bits_equal  # noqa: F401

SEED = 11
FLIPS = int(os.environ.get("CKPTDELTA_FLIPS", "8"))       # per object in the fast matrix
#: an error names what is damaged: an object key (possibly the damaged key itself), the head pointer, a snapshot
NAMES_OBJECT = re.compile(r"(anchors|deltas|manifests)/|\d{12}-|HEAD|RUN\.json|v\d{8}|version \d+")


def _fingerprint(tensors: dict[str, torch.Tensor]) -> tuple:
    """(name, digest of the bits, dtype, shape) of each tensor, sorted by name."""
    return tuple((n, (digest(tensors[n]), str(tensors[n].dtype), tuple(tensors[n].shape))) for n in sorted(tensors))


class Damage:
    """Damage one file of a local bucket and put it back exactly as it was."""

    def __init__(self, root: str, key: str):
        self.path = os.path.join(root, key)
        with open(self.path, "rb") as f:
            self.original = f.read()

    def write(self, data: bytes) -> None:
        with open(self.path, "wb") as f:
            f.write(data)

    def flip(self, pos: int, bit: int) -> None:
        data = bytearray(self.original)
        data[pos] ^= 1 << bit
        self.write(bytes(data))

    def truncate(self, n: int) -> None:
        self.write(self.original[:n])

    def restore(self) -> None:
        self.write(self.original)


# --- 1. every object, random flips and truncations ---------------------------------------------------

@dataclass
class MatrixFigures:
    damaged: Counter = field(default_factory=Counter)          # kind -> damages done
    read_refused: Counter = field(default_factory=Counter)     # read_tensors raised a ckptdelta error
    read_exact: Counter = field(default_factory=Counter)       # the damage touched no byte the read needs
    read_renamed: Counter = field(default_factory=Counter)     # an anchor tensor read under another name
    verify_caught: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def report(self, label: str) -> str:
        lines = [f"corruption at rest [{label}] seed={SEED}: damages -> read refused / read exact / "
                 "read renamed / verify caught"]
        for kind in sorted(self.damaged):
            lines.append(f"  {kind:<12} {self.damaged[kind]:4d} -> {self.read_refused[kind]:4d} / "
                         f"{self.read_exact[kind]:4d} / {self.read_renamed[kind]:4d} / {self.verify_caught[kind]:4d}")
        lines.append(f"  total damages={sum(self.damaged.values())} wrong bits served=0 expected, "
                     f"violations={len(self.violations)}")
        lines += [f"    - {v}" for v in self.violations[:20]]
        return "\n".join(lines)


def _publish_small_run(url: str) -> dict[int, dict[str, torch.Tensor]]:
    """v0 anchor (five shards, an index, config.json), v1-v2 deltas, v3 anchor, v4 delta."""
    truth = {}
    with Publisher(url, anchor_every=3, shard_bytes=SHARD_BYTES, extra_files={"config.json": CONFIG},
                   progress=False) as pub:
        for v in range(5):
            truth[v] = weights_for(SEED, v)
            assert pub.publish(truth[v], 10 * v).version == v
    return truth


def _objects(url: str) -> list[tuple[str, str, int]]:
    """(kind, key, version whose read depends on it) for every stored object of the run."""
    reader = SnapshotReader(url)
    latest = reader.latest()
    out: list[tuple[str, str, int]] = [("HEAD", HEAD_KEY, latest), ("RUN.json", RUN_KEY, latest)]
    for v in reader.versions():
        m = reader.manifest(v)
        out.append(("manifest", manifest_key(v), v))
        for o in m.objects:
            kind = "delta" if m.kind == "delta" else ("index" if o.key.endswith(".json") else "shard")
            out.append((kind, o.key, v))
        out += [("extra file", o.key, v) for o in m.extra_files]
    return out


def _damage_matrix(url: str, truth: dict, flips: int, truncations: int) -> MatrixFigures:
    fig = MatrixFigures()
    rng = random.Random(SEED)
    exact = {v: _fingerprint(t) for v, t in truth.items()}
    latest = max(truth)
    for kind, key, v in _objects(url):
        d = Damage(url, key)
        size = len(d.original)
        damages: list[tuple[str, Callable[[], None]]] = []
        for _ in range(flips):
            pos, bit = rng.randrange(size), rng.randrange(8)
            damages.append((f"bit {bit} of byte {pos}", lambda pos=pos, bit=bit: d.flip(pos, bit)))
        for n in [0] + [rng.randrange(size) for _ in range(truncations - 1)]:
            damages.append((f"truncated to {n} bytes", lambda n=n: d.truncate(n)))
        for what, damage in damages:
            where = f"{key} ({what})"
            fig.damaged[kind] += 1
            damage()
            try:
                _check_damaged(fig, url, kind, key, v, latest, exact, where)
            finally:
                d.restore()
    return fig


def _check_damaged(fig: MatrixFigures, url: str, kind: str, key: str, v: int, latest: int, exact: dict,
                   where: str) -> None:
    reader = SnapshotReader(url)
    target = latest if kind in ("HEAD", "RUN.json") else v
    renamed = False
    try:
        if kind == "HEAD" and reader.latest() != latest:
            raise AssertionError(f"latest resolved to {reader.latest()}")
        got = dict(_fingerprint(reader.read_tensors(target)))
    except CkptDeltaError as e:
        fig.read_refused[kind] += 1
        if not NAMES_OBJECT.search(str(e)):
            fig.violations.append(f"{where}: the error names no object: {e}")
    except Exception as e:  # noqa: BLE001 - anything else is not a clear error
        fig.violations.append(f"{where}: read failed with {type(e).__name__}: {e}")
    else:
        want = dict(exact[target])
        wrong = [n for n in got if n in want and got[n] != want[n]]
        if wrong:
            fig.violations.append(f"{where}: read_tensors({target}) returned wrong bits for {wrong[:3]}")
        elif got != want:   # names changed, bits did not: only verify (and a replica's name check) can tell
            fig.read_renamed[kind] += 1
            renamed = True
        else:
            fig.read_exact[kind] += 1
    try:
        SnapshotReader(url).verify(target)
    except CkptDeltaError:
        fig.verify_caught[kind] += 1
    except Exception as e:  # noqa: BLE001
        fig.violations.append(f"{where}: verify failed with {type(e).__name__}: {e}")
    else:
        if renamed:
            fig.violations.append(f"{where}: verify({target}) passed over a renamed tensor")
        if kind in ("shard", "delta", "index", "extra file"):
            fig.violations.append(f"{where}: verify({target}) passed over a damaged data object")
        if kind == "manifest" and v == latest:
            fig.violations.append(f"{where}: verify passed over a damaged manifest that HEAD names")


def _run_matrix(tmp_path, flips: int, truncations: int, label: str) -> None:
    url = str(tmp_path / "run")
    truth = _publish_small_run(url)
    fig = _damage_matrix(url, truth, flips, truncations)
    print()
    print(fig.report(label))
    assert fig.violations == [], fig.report(label)
    for kind in ("shard", "delta", "manifest"):
        assert fig.read_refused[kind] > 0, fig.report(label)


def test_every_object_flipped_or_truncated_is_refused_or_harmless_never_wrong_bits(tmp_path):
    _run_matrix(tmp_path, FLIPS, 2, "fast")


@pytest.mark.slow
def test_every_object_flipped_at_many_positions(tmp_path):
    _run_matrix(tmp_path, 48, 6, "long")


def _renamed_manifest(url: str, v: int, old: str, new: str) -> Damage:
    """Rewrite one tensor name in manifest ``v`` as a single flipped bit would (same length, valid JSON)."""
    d = Damage(url, manifest_key(v))
    needle = f'"{old}":'.encode()
    assert d.original.count(needle) == 1 and len(old) == len(new)
    d.write(d.original.replace(needle, f'"{new}":'.encode()))
    return d


def test_a_bit_flip_that_duplicates_a_tensor_name_in_a_manifest_is_refused(tmp_path):
    """Regression: 'layers.1.norm' -> 'layers.0.norm' is one bit; JSON kept the last of the two entries,
    so read_tensors returned layers.1.norm's bits as layers.0.norm."""
    url = str(tmp_path / "run")
    _publish_small_run(url)
    _renamed_manifest(url, 3, "layers.1.norm", "layers.0.norm")
    with pytest.raises(CkptDeltaError, match="duplicate"):
        SnapshotReader(url).read_tensors(3)


def test_verify_catches_an_anchor_tensor_renamed_in_its_manifest(tmp_path):
    """Regression: an anchor's tensor bits are bound to their manifest entry by digest, but nothing bound
    the entry's name to them: a flipped bit in the name read back as a tensor of another name, and
    verify passed. verify now checks each shard's safetensors header against the manifest."""
    url = str(tmp_path / "run")
    truth = _publish_small_run(url)
    _renamed_manifest(url, 3, "layers.0.mlp.down", "layers.0.mlp.eown")
    got = SnapshotReader(url).read_tensors(3)      # the read path trusts the manifest's names ...
    assert "layers.0.mlp.eown" in got and "layers.0.mlp.down" not in got
    assert all(_fingerprint({n: got[n]}) == _fingerprint({n: truth[3][n]}) for n in got if n in truth[3])
    with pytest.raises(CkptDeltaError, match="layers.0.mlp"):   # ... verify does not
        SnapshotReader(url).verify(3)
    live = {k: t.clone() for k, t in truth[1].items()}               # nor does a replica: names must match
    with pytest.raises(CkptDeltaError, match="layers.0.mlp"):
        HotSwapper(live, SnapshotReader(url), version=1).prepare(3)


# --- 2 and 3. targeted damage against a HotSwapper and a live replica ----------------------------------

@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, lm_dir):  # noqa: F811
    """The tiny LM: v0 anchor, v1-v2 deltas, v3 anchor, v4 delta."""
    run = publish_run(str(tmp_path_factory.mktemp("bucket") / "run"), lm_dir, n_versions=3)
    new = rl_step(run.truth[2], seed=303)
    r = run.publisher.publish(new, 3, anchor=True)
    assert r.kind == "anchor"
    run.truth[3] = {k: v.clone() for k, v in new.items()}
    run.publish_next()
    run.publisher.wait_until_finished()   # its HEAD moves in the background: settled before a test damages HEAD
    yield run
    run.close()


def _record(m: Manifest) -> tuple[str, int]:
    """(object key, offset) in the middle of the largest stored tensor of a snapshot."""
    name = max((n for n, e in m.tensors.items() if e.object is not None), key=lambda n: m.tensors[n].length)
    e = m.tensors[name]
    return m.objects[e.object].key, e.offset + e.length // 2


def _damage(run, case: str) -> tuple[Damage, "str | int"]:
    """Apply ``case`` to the run's bucket; returns the Damage (to restore) and the hot-load target."""
    reader = SnapshotReader(run.url)
    if case in ("delta-flip", "delta-truncate", "anchor-flip", "anchor-truncate"):
        v = 2 if case.startswith("delta") else 3
        key, mid = _record(reader.manifest(v))
        d = Damage(run.url, key)
        d.flip(mid, 3) if case.endswith("flip") else d.truncate(len(d.original) // 2)
        return d, v
    if case in ("manifest-truncate", "manifest-digest"):
        # version 4: one the replica's reader never read (it caches committed manifests, which never
        # change, so damage to one it already holds cannot reach it)
        d = Damage(run.url, manifest_key(4))
        if case == "manifest-truncate":
            d.truncate(len(d.original) // 2)
        else:  # valid JSON that lies about one tensor's digest
            doc = json.loads(d.original)
            name = next(n for n, e in doc["tensors"].items() if e["object"] is not None)
            h = doc["tensors"][name]["xxh3"]
            doc["tensors"][name]["xxh3"] = ("1" if h[0] != "1" else "2") + h[1:]
            d.write(json.dumps(doc).encode())
        return d, 4
    if case in ("head-garbage", "head-truncate"):
        d = Damage(run.url, HEAD_KEY)
        d.write(b"\x00\xffnot a head pointer") if case == "head-garbage" else d.truncate(len(d.original) // 2)
        return d, "latest"
    raise ValueError(case)


CASES = ["delta-flip", "delta-truncate", "anchor-flip", "anchor-truncate", "manifest-truncate",
         "manifest-digest", "head-garbage", "head-truncate"]


@pytest.mark.parametrize("case", CASES)
def test_hotswapper_refuses_a_corrupt_update_and_keeps_the_old_bits(lm_run, case):
    live = {k: v.clone() for k, v in lm_run.truth[1].items()}
    swapper = HotSwapper(live, SnapshotReader(lm_run.url), version=1)
    d, target = _damage(lm_run, case)
    try:
        with pytest.raises(CkptDeltaError) as ei:
            swapper.prepare(target)
        assert NAMES_OBJECT.search(str(ei.value)), str(ei.value)
        print(f"\n  {case}: {type(ei.value).__name__}: {str(ei.value)[:160]}")
    finally:
        d.restore()
    assert swapper.version == 1 and _fingerprint(live) == _fingerprint(lm_run.truth[1])
    swapper.hotload(4)                                   # repaired: the update goes through
    assert _fingerprint(live) == _fingerprint(lm_run.truth[4])


@pytest.fixture(scope="module")
def replica(lm_run):
    engine, reader = load_engine(bucket=lm_run.url, snapshot=1)
    rep = Replica(engine, reader=reader, replica_id="corrupt-0")
    yield rep
    rep.close()


@pytest.mark.parametrize("case", CASES)
def test_replica_fails_a_corrupt_hotload_and_keeps_serving_its_version(lm_run, replica, case):
    assert replica.status()["policy_version"] == 1
    d, target = _damage(lm_run, case)
    try:
        r = replica.post("/v1/hotload", {"snapshot": target})
        if r.status_code == 202:
            job = replica.wait(r.json()["id"])
            assert job["state"] == "FAILED", job
            reason = job["reason"]
        else:   # refused before any work: the manifest or head pointer itself is unreadable
            assert r.status_code in (400, 404, 502, 503), r.text
            reason = r.json()["error"]["message"]
        assert NAMES_OBJECT.search(reason), reason
        print(f"\n  {case}: {r.status_code} {reason[:160]}")
    finally:
        d.restore()
    status = replica.status()
    assert status["policy_version"] == 1 and status["state"] == "READY", status
    assert state_bits_equal(replica.engine.model, lm_run.truth[1]) == []
    body = replica.complete(max_tokens=2, return_engine_data=True)
    assert body["engine_data"]["policy_version"] == 1


def test_replica_hotloads_once_the_bucket_is_repaired(lm_run, replica):
    assert replica.hotload(4)["state"] == "READY"
    assert state_bits_equal(replica.engine.model, lm_run.truth[4]) == []
    assert replica.hotload(1)["state"] == "READY"       # and back, for whoever runs next
    assert state_bits_equal(replica.engine.model, lm_run.truth[1]) == []
