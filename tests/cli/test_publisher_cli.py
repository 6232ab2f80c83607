"""``publish``, ``ls`` and ``gc`` from the command line, and a publisher process killed mid-publish."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import safetensors.torch

from ckptdelta.publisher import collect
from ckptdelta.cli import publish as cli
from tests.publisher_helpers import assert_same, clone, open_store, perturb, snapshot, versions, weights
from tests import REPO



def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ckptdelta")
    cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def model_dir(path, w, shards: int = 2) -> str:
    """A Hugging Face style directory: sharded safetensors + index, config, tokenizer files."""
    path.mkdir(exist_ok=True)
    names = list(w)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        safetensors.torch.save_file({n: w[n].contiguous() for n in group}, str(path / fname),
                                    metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "generation_config.json").write_text("{}")
    (path / "pytorch_model.bin").write_bytes(b"old weights, not copied")
    return str(path)


def test_publish_ls_gc_with_json(tmp_path, store_url, capsys):
    url, opts = store_url
    so = ["--storage-options", json.dumps(opts)] if opts else []
    w = weights()
    history = []
    for step in range(4):
        history.append(clone(w))
        src = model_dir(tmp_path / f"m{step}", w)
        extra = ["--anchor"] if step == 2 else []
        assert run_cli(["publish", src, url, "--step", str(step), "--json", "--metadata", f"run=cli{step}",
                        *extra, *so]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["version"] == step and out["name"] == f"v{step:08d}"
        assert out["kind"] == ("anchor" if step in (0, 2) else "delta")
        assert out["full_bytes"] == sum(t.numel() * t.element_size() for t in w.values())
        assert out["stored_bytes"] > 0
        perturb(w, seed=step)

    store = open_store(store_url)
    for v, want in enumerate(history):
        assert_same(snapshot(store, v), want)
    anchor_files = sorted(k.rsplit("/", 1)[1] for k in store.list_prefix("anchors/000000000000-"))
    assert anchor_files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]

    assert run_cli(["ls", url, "--json", *so]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["kind"], r["parent"]) for r in rows] == \
        [(0, "anchor", None), (1, "delta", 0), (2, "anchor", 1), (3, "delta", 2)]
    assert all({"name", "stored_bytes", "full_bytes", "ratio", "created"} <= set(r) for r in rows)
    assert run_cli(["ls", url, *so]) == 0
    assert "v00000003" in capsys.readouterr().out

    assert run_cli(["gc", url, "--keep-anchors", "1", "--json", *so]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted_versions"] == [0, 1] and report["kept_versions"] == [2, 3]
    assert versions(store) == [2, 3]
    assert_same(snapshot(store, 3), history[3])


def test_cli_errors_are_one_line_and_exit_1(tmp_path, capsys):
    w = weights()
    src = model_dir(tmp_path / "m", w)
    url = str(tmp_path / "run")
    assert run_cli(["publish", src, url, "--step", "5"]) == 0
    capsys.readouterr()
    assert run_cli(["publish", src, url, "--step", "4"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ckptdelta publish: error:") and "step 4" in err and err.count("\n") == 1
    assert run_cli(["publish", str(tmp_path / "missing"), url, "--step", "6"]) == 1
    assert run_cli(["ls", url, "--storage-options", "[1]"]) == 2   # a usage error


def test_publish_codec_flag_picks_the_delta_codec_and_every_mix_reads_back(tmp_path, capsys):
    w = weights()
    url = str(tmp_path / "run")
    history, codecs = [], []
    for step, flags in enumerate(([], ["--codec", "fast"], ["--codec", "context"], ["--codec", "fast"])):
        history.append(clone(w))
        assert run_cli(["publish", model_dir(tmp_path / f"m{step}", w), url, "--step", str(step), "--json",
                        *flags]) == 0
        codecs.append(json.loads(capsys.readouterr().out)["codec"])
        perturb(w, seed=step)
    assert codecs == ["", "fast", "context", "fast"]   # the first publish is an anchor
    store = open_store((url, None))
    for v, want in enumerate(history):
        assert_same(snapshot(store, v), want)


def test_storage_option_flags_nest_and_parse_json_values():
    ns = argparse.Namespace(storage_options='{"anon": false}',
                            storage_option=["client_kwargs.endpoint_url=http://127.0.0.1:9000", "retries=3"])
    assert cli.storage_options(ns) == {"anon": False, "retries": 3,
                                       "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}


KILLED_PUBLISHER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from tests.publisher_helpers import weights, perturb
    from ckptdelta.publisher import Publisher
    w = weights()
    pub = Publisher(sys.argv[1], shard_bytes=6000)
    pub.publish(w, 0)
    real = pub.store.put_if_absent
    def die(key, data):
        if key.startswith("manifests/"):
            os._exit(9)   # the process dies with every data object uploaded, just before the commit
        return real(key, data)
    pub.store.put_if_absent = die
    perturb(w, seed=0)
    pub.publish(w, 1, anchor=True)
    print("not reached")
""")


def test_a_publisher_process_killed_before_its_commit_leaves_nothing_visible(tmp_path):
    url = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-c", KILLED_PUBLISHER, url, REPO], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 9, proc.stderr
    store = open_store((url, {}))
    assert versions(store) == [0]
    debris = [k for k in store.list_prefix("anchors/") if k.startswith("anchors/000000000001-")]
    assert debris
    report = collect(url, grace_seconds=0)
    assert set(report.deleted_objects) == set(debris) and versions(store) == [0]
    assert_same(snapshot(store, 0), weights())
