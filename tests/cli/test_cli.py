"""The ``ckptdelta`` command as a user meets it: help that lists every command, inspect, clean errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

from ckptdelta import delta
from ckptdelta.cli import main
from ckptdelta.delta.container import ObjectWriter

COMMANDS = ("publish", "ls", "gc", "serve", "hotload", "status", "materialize", "verify", "inspect")


def test_help_lists_every_command_with_examples():
    out = subprocess.run([sys.executable, "-m", "ckptdelta", "--help"], capture_output=True, text=True, check=True)
    for cmd in COMMANDS:
        assert f"    {cmd}" in out.stdout
    assert "examples:" in out.stdout


def test_every_subcommand_has_help(capsys):
    for cmd in COMMANDS:
        try:
            main([cmd, "--help"])
        except SystemExit as e:
            assert e.code == 0
        assert "usage: ckptdelta " + cmd in capsys.readouterr().out


def _object(tmp_path):
    old = torch.randn(300, 40).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[::97] = 1.5
    buf = io.BytesIO()
    w = ObjectWriter(buf)
    w.add("w", delta.encode(old, new, name="w").to_bytes())
    w.add("b", delta.encode(None, torch.arange(5, dtype=torch.int64), name="b").to_bytes())
    w.finish()
    path = tmp_path / "rank-00000.ckd"
    path.write_bytes(buf.getvalue())
    return path


def test_inspect_describes_each_tensor_of_a_delta_object(tmp_path, capsys):
    path = _object(tmp_path)
    assert main(["inspect", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    by_name = {t["name"]: t for t in got["tensors"]}
    assert by_name["w"]["dtype"] == "BF16" and by_name["w"]["shape"] == [300, 40]
    assert by_name["w"]["chunks"] == {"sparse": 1}
    assert by_name["b"]["has_parent"] is False


def test_a_reader_that_stops_reading_ends_the_command_quietly_with_status_0(tmp_path):
    """``ckptdelta ... | head``: the pipe closes under the command; no "Broken pipe", no traceback, exit 0."""
    buf = io.BytesIO()
    w = ObjectWriter(buf)
    for i in range(4000):      # ~0.5 MB of --json: far past a pipe's buffer
        w.add(f"layers.{i}.weight", delta.encode(None, torch.arange(4, dtype=torch.int64), name=f"t{i}").to_bytes())
    w.finish()
    path = tmp_path / "rank-00000.ckd"
    path.write_bytes(buf.getvalue())
    proc = subprocess.Popen([sys.executable, "-m", "ckptdelta", "inspect", str(path), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(100)       # it has started writing; now the reader goes away
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_a_corrupt_object_is_a_one_line_error_with_exit_status_1(tmp_path, capsys):
    path = _object(tmp_path)
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ckptdelta inspect: error:") and "\n" not in err
    assert "'w'" in err or "tensor" in err


def test_a_missing_run_is_a_clean_error(tmp_path, capsys):
    rc = main(["ls", str(tmp_path / "no-such-run")])
    out = capsys.readouterr()
    assert rc in (0, 1)
    assert "Traceback" not in out.err


@pytest.mark.parametrize("argv", [["serve"], ["serve", "--engine", "vllm"], ["serve", "--engine", "vllm", "--model", "x"],
                                  ["serve", "--bucket", "x", "--", "--max-model-len", "8"]])
def test_a_serve_without_what_it_needs_is_a_one_line_usage_error_with_exit_status_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "serve --help" in err and "Traceback" not in err


def test_ls_and_gc_on_a_path_that_is_not_a_run_say_so_and_exit_1(tmp_path, capsys):
    from ckptdelta.publisher import Publisher

    url = str(tmp_path / "bucket" / "run")
    with Publisher(url, progress=False) as pub:
        pub.publish({"w": torch.zeros(4)}, 0)
    for path in (str(tmp_path / "typo"), str(tmp_path / "bucket"), url + "/manifests"):
        for cmd in (["ls", path], ["gc", path]):
            assert main(cmd) == 1, cmd
            err = capsys.readouterr().err
            assert "no run at" in err and err.count("\n") == 1, err
    assert main(["ls", url]) == 0 and "v00000000" in capsys.readouterr().out


def test_every_command_that_reaches_a_bucket_takes_the_same_storage_flags(tmp_path, capsys):
    from ckptdelta.cli import build_parser
    from ckptdelta.publisher import Publisher

    url = str(tmp_path / "run")
    with Publisher(url, progress=False) as pub:
        pub.publish({"w": torch.zeros(4)}, 0)
    flags = ["--storage-options", '{"auto_mkdir": true}', "--storage-option", "auto_mkdir=true"]
    assert main(["verify", url, *flags]) == 0
    assert main(["materialize", url, "latest", str(tmp_path / "out"), *flags]) == 0
    assert main(["ls", url, *flags]) == 0
    assert main(["gc", url, "--dry-run", *flags]) == 0
    capsys.readouterr()
    args = build_parser().parse_args(["serve", "--bucket", url, "--storage-option", "client_kwargs.region=x"])
    from ckptdelta.cli.options import storage_options
    assert storage_options(args) == {"client_kwargs": {"region": "x"}}
    assert main(["verify", url, "--storage-option", "novalue"]) == 2   # a usage error
    assert "K=V" in capsys.readouterr().err
