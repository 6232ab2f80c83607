"""Manifests, head pointers and RUN.json: what is written reads back, anything else is rejected.

A manifest decides which bytes a replica fetches and trusts, so every field is
checked before use; each failure is a ManifestError (RunMismatchError for a
manifest of another run) naming the snapshot, never a KeyError or TypeError.
"""

from __future__ import annotations

import copy
import json

import pytest

from ckptdelta.delta import manifest as m
from ckptdelta.delta.errors import ManifestError, RunMismatchError
from tests.attacks.make_attacks import valid_manifest


def _bytes(d) -> bytes:
    return json.dumps(d).encode()


def _anchor() -> m.Manifest:
    return m.Manifest(
        run_id="run-1", version=0, kind="anchor", parent_version=None, anchor_version=0,
        created=m.now_iso(), step=0, writer_id="ab12cd34",
        objects=(m.ObjectRef(m.anchor_prefix(0, "ab12cd34") + "/model.safetensors", 4096, "0123456789abcdef"),),
        tensors={"w": m.TensorEntry("BF16", (16, 32), "00000000000000ff", 0, 100, 1024),
                 "s": m.TensorEntry("F32", (), "00000000000000aa", 0, 1124, 4)},
        extra_files=(m.ObjectRef(m.anchor_prefix(0, "ab12cd34") + "/config.json", 10, "aaaaaaaaaaaaaaaa"),),
        metadata={"lr": "1e-6"}, full_bytes=1028, stored_bytes=4106,
    )


def test_manifests_round_trip_exactly():
    for man in (_anchor(), m.Manifest.from_json(_bytes(valid_manifest()))):
        back = m.Manifest.from_json(man.to_json(), run_id=man.run_id)
        assert back == man
        assert back.to_json() == man.to_json()
    a = _anchor()
    assert a.name == "v00000000" and a.tensors["w"].numel == 512 and a.tensors["w"].nbytes == 1024
    assert a.tensors["s"].numel == 1 and "version 0" in a.where() and "run-1" in a.where()


def test_head_and_run_info_round_trip():
    h = m.Head("run-1", 42, "0123456789abcdef")
    assert m.Head.from_json(h.to_json()) == h
    assert json.loads(h.to_json())["name"] == "v00000042"
    r = m.RunInfo("run-1", m.now_iso())
    assert m.RunInfo.from_json(r.to_json()) == r


def test_a_manifest_of_another_run_is_refused():
    data = _bytes(valid_manifest())
    with pytest.raises(RunMismatchError, match="run-expected.*other|other.*run-expected"):
        m.Manifest.from_json(data, run_id="other")
    assert m.Manifest.from_json(data, run_id="run-expected").run_id == "run-expected"
    assert m.Manifest.from_json(data).run_id == "run-expected"  # no expectation, no check


def _set(d: dict, path: str, value):
    node, keys = d, path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = int(keys[-1]) if isinstance(node, list) else keys[-1]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


class _Deleted:
    """The field left out (a repr of its own keeps the test ids the same in every process)."""

    def __repr__(self) -> str:
        return "<deleted>"


_DELETE = _Deleted()

BROKEN = [
    ("format", "ckptdelta-head"), ("format", _DELETE), ("schema_version", 2), ("schema_version", "1"),
    ("version", -1), ("version", True), ("version", 2.0), ("version", 1 << 62), ("version", "2"), ("version", _DELETE),
    ("name", "v2"), ("name", "v00000003"),
    ("kind", "full"), ("kind", None), ("kind", ["delta"]),
    ("parent_version", 2), ("parent_version", -1), ("parent_version", True), ("parent_version", "1"),
    ("parent_version", None),  # a delta needs a parent
    ("anchor_version", 3), ("anchor_version", -1),
    ("run_id", ""), ("run_id", 5), ("run_id", "x" * 257), ("run_id", _DELETE),
    ("created", None), ("writer_id", ""), ("step", "20"), ("step", 1.5), ("step", True),
    ("objects", {}), ("objects.0", "deltas/x"), ("objects.0.key", "/abs/key"), ("objects.0.key", "../x"),
    ("objects.0.key", "deltas/../../x"), ("objects.0.key", "deltas//x"), ("objects.0.key", "deltas/./x"),
    ("objects.0.key", "deltas\\x"), ("objects.0.key", ""), ("objects.0.key", "a/b\x00"), ("objects.0.key", 7),
    ("objects.0.size", -1), ("objects.0.size", "1000"), ("objects.0.size", None),
    ("objects.0.xxh3", "0011"), ("objects.0.xxh3", "00112233445566FF"), ("objects.0.xxh3", 5),
    ("extra_files", [{"key": "../config.json", "size": 1, "xxh3": "0011223344556677"}]),
    ("tensors", []), ("tensors", None), ("tensors.w", []),
    ("tensors.w.dtype", "float32"), ("tensors.w.dtype", ["BF16"]), ("tensors.w.dtype", {"x": 1}),
    ("tensors.w.dtype", None),
    ("tensors.w.shape", [-1, 20]), ("tensors.w.shape", [10.0, 20]), ("tensors.w.shape", [True, 20]),
    ("tensors.w.shape", "10,20"), ("tensors.w.shape", [1] * 33), ("tensors.w.shape", [1 << 48, 1]),
    ("tensors.w.shape", [1 << 30, 1 << 30]),
    ("tensors.w.xxh3", "xyz"), ("tensors.w.xxh3", None),
    ("tensors.w.object", 1), ("tensors.w.object", -1), ("tensors.w.object", True), ("tensors.w.object", "0"),
    ("tensors.w.offset", 900), ("tensors.w.offset", -8), ("tensors.w.length", 1 << 40), ("tensors.w.length", None),
    ("tensors.b.offset", 8),  # an unchanged entry with a byte range
    ("metadata", {"k": 1}), ("metadata", ["k"]), ("metadata", {"k": "x" * (1 << 20)}),
    ("full_bytes", -1), ("full_bytes", _DELETE), ("stored_bytes", "1"),
]


@pytest.mark.parametrize("path,value", BROKEN, ids=[f"{p}={v!r}"[:60] for p, v in BROKEN])
def test_each_broken_field_is_a_manifest_error_naming_the_snapshot(path, value):
    d = valid_manifest()
    _set(d, path, value)
    with pytest.raises(ManifestError) as info:
        m.Manifest.from_json(_bytes(d), what="manifests/000000000002.json")
    assert "manifests/000000000002.json" in str(info.value)


def test_tensor_names_must_be_valid_utf8_and_bounded():
    for bad in ("\ud800", "", "x" * 4097):
        d = valid_manifest()
        d["tensors"][bad] = d["tensors"].pop("w")
        with pytest.raises(ManifestError, match="tensor name"):
            m.Manifest.from_json(_bytes(d))
    d = valid_manifest()
    d["tensors"]["层.ß"] = d["tensors"].pop("w")
    assert "层.ß" in m.Manifest.from_json(_bytes(d)).tensors


def test_anchor_entries_must_cover_exactly_the_tensor_bytes():
    a = json.loads(_anchor().to_json())
    a["tensors"]["w"]["length"] = 1023
    with pytest.raises(ManifestError, match="length 1023"):
        m.Manifest.from_json(_bytes(a))
    a = json.loads(_anchor().to_json())
    a["tensors"]["w"]["object"] = None
    a["tensors"]["w"]["offset"] = a["tensors"]["w"]["length"] = 0
    with pytest.raises(ManifestError, match="unchanged entry outside a delta"):
        m.Manifest.from_json(_bytes(a))
    a = json.loads(_anchor().to_json())
    a["anchor_version"] = 0
    a["version"], a["name"] = 1, "v00000001"  # an anchor's anchor is itself
    with pytest.raises(ManifestError, match="anchor_version"):
        m.Manifest.from_json(_bytes(a))


@pytest.mark.parametrize("data", [
    b"", b"null", b"[]", b'"manifest"', b"{", b"\xff\xfe\x00", b'{"format": "\xff"}', b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000, b'{"version": 1' + b"0" * 5000 + b"}", b"NaN",
])
def test_malformed_json_is_a_manifest_error(data):
    for parse in (m.Manifest.from_json, m.Head.from_json, m.RunInfo.from_json):
        with pytest.raises(ManifestError):
            parse(data)


def test_oversized_documents_are_refused_before_parsing():
    big = b" " * (m.MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ManifestError, match="exceeds"):
        m.Manifest.from_json(big)
    del big
    head = b" " * (m.MAX_HEAD_BYTES + 1)
    for parse in (m.Head.from_json, m.RunInfo.from_json):
        with pytest.raises(ManifestError, match="exceeds"):
            parse(head)


def test_head_and_run_info_fields_are_checked():
    good = json.loads(m.Head("run-1", 3, "0123456789abcdef").to_json())
    for key, value in [("manifest_xxh3", "0123"), ("version", -3), ("version", "3"), ("run_id", ""),
                       ("format", "ckptdelta-manifest"), ("schema_version", 9)]:
        d = copy.deepcopy(good)
        d[key] = value
        with pytest.raises(ManifestError):
            m.Head.from_json(_bytes(d))
    for d in ({"format": "ckptdelta-run", "run_id": "", "created": "t"}, {"format": "x", "run_id": "r", "created": "t"},
              {"format": "ckptdelta-run", "run_id": "r"}):
        with pytest.raises(ManifestError):
            m.RunInfo.from_json(_bytes(d))


# --- layout ------------------------------------------------------------------------------------

def test_layout_keys_round_trip_and_sort_by_version():
    for v in (0, 7, 12345678, 10 ** 11):
        assert m.parse_snapshot_name(m.snapshot_name(v)) == v
        assert m.version_of_manifest_key(m.manifest_key(v)) == v
        assert m.is_safe_key(m.manifest_key(v))
        assert m.is_safe_key(m.delta_prefix(v, "ab12") + "/rank-00000.ckd")
        assert m.is_safe_key(m.anchor_prefix(v, "ab12") + "/model.safetensors")
    keys = [m.manifest_key(v) for v in (10, 9, 100, 0)]
    assert sorted(keys) == [m.manifest_key(v) for v in (0, 9, 10, 100)]
    for bad in ("v1", "v0000001", "x00000001", "v00000001a"):
        assert m.parse_snapshot_name(bad) is None
    for bad in ("manifests/1.json", "manifests/000000000001.json.tmp", "other/000000000001.json"):
        assert m.version_of_manifest_key(bad) is None


@pytest.mark.parametrize("key,safe", [
    ("a", True), ("a/b.c-d_e", True), ("deltas/000000000001-ab/rank-00000.ckd", True), ("..a/b", True),
    ("", False), ("/a", False), ("a/", False), ("a//b", False), (".", False), ("..", False), ("a/./b", False),
    ("a/../b", False), ("a\\b", False), ("a b", False), ("a\x00b", False), ("ä", False), ("a/\n", False),
])
def test_safe_keys_cannot_leave_the_run(key, safe):
    assert m.is_safe_key(key) is safe
