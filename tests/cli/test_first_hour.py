"""A new user's first hour (issue 15): what the README leads to must work, and every mistake on the way
must end in one line that names the object and the fix, within seconds.

Command-line cases run the real console script (``ckptdelta`` next to this interpreter) in a subprocess and
check the exit status and the first line of stderr; they run a few at a time, since each one pays for
importing torch. The rest call the library.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptdelta.cli import COMMANDS, main
from ckptdelta.delta.errors import NotServableError, StorageError
from ckptdelta.delta.storage import RetryPolicy, Store
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.loader.servable import check_snapshot
from ckptdelta.publisher import Publisher
from tests.publisher_helpers import weights
from tests.servers import free_port
from tests.cli.test_publisher_cli import model_dir

CKPTDELTA = os.path.join(os.path.dirname(sys.executable), "ckptdelta")


def ckptdelta(*argv: str, timeout: float = 120) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of the console script."""
    env = {k: v for k, v in os.environ.items() if k != "CKPTDELTA_STORAGE_TIMEOUT"}
    t0 = time.monotonic()
    p = subprocess.run([CKPTDELTA, *argv], capture_output=True, text=True, timeout=timeout, env=env,
                       stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def first_line(err: str) -> str:
    return err.strip().splitlines()[0] if err.strip() else ""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs a replica cannot serve (the README's old trainer snippet and a bare dict) and one it can."""
    root = tmp_path_factory.mktemp("first-hour")
    w = weights()
    out = {}
    for name, extra in (("config-only", {"config.json": b'{"model_type": "llama"}'}), ("bare", None),
                        ("servable", str(model_dir(root / "model", w)))):
        url = str(root / "bucket" / name)
        with Publisher(url, extra_files=extra, progress=False) as pub:
            pub.publish(w, 0)
        out[name] = url
    out["root"] = str(root)
    return out


# --- item 1: the library path publishes what serving needs; serve checks before it loads -----------------

def test_extra_files_can_be_a_model_directory_the_same_files_the_cli_bundles(tmp_path):
    from ckptdelta.cli.publish import load_source

    w = weights()
    src = model_dir(tmp_path / "m", w)
    url = str(tmp_path / "run")
    with Publisher(url, extra_files=src, progress=False) as pub:
        pub.publish(w, 0)
    r = SnapshotReader(url)
    names = sorted(rel for rel, _ in r.extra_files(0))
    assert names == sorted(load_source(src)[1]) == ["config.json", "generation_config.json", "tokenizer.json"]
    check_snapshot(r, 0)                                    # servable
    with pytest.raises(Exception, match="not a directory"):
        Publisher(str(tmp_path / "other"), extra_files=str(tmp_path / "nodir"))


def test_a_transformers_model_brings_its_own_config_and_a_missing_tokenizer_is_a_warning(tmp_path, caplog):
    from tests.lm import build_model

    model = build_model(64, hidden=32, layers=1)
    url = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"), Publisher(url, progress=False) as pub:
        pub.publish(model, 0)
        pub.publish(model, 1)
    warnings = [r.getMessage() for r in caplog.records if "tokenizer" in r.getMessage()]
    assert len(warnings) == 1 and "extra_files=MODEL_DIR" in warnings[0]
    r = SnapshotReader(url)
    extra = dict(r.extra_files(1))
    assert sorted(extra) == ["config.json", "generation_config.json"]
    config = json.loads(r.read_object(extra["config.json"]))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    with pytest.raises(NotServableError, match="no tokenizer files") as e:
        check_snapshot(r, 1)
    assert "config.json" not in str(e.value).split("carries no")[1].split(";")[0]


# --- the command line, all at once ------------------------------------------------------------------------

def _silent_server() -> socket.socket:
    """Accepts connections (the kernel does) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def _check(argv: list[str], want_rc: int, needle: str, rc: int, err: str, seconds: float,
           slack: float = 25.0) -> str | None:
    """What is wrong with how a command ended (None if nothing). ``slack``: seconds a command may take beyond
    its --storage-timeout (a new process imports torch first: seconds on a busy machine)."""
    line = first_line(err)
    prog = f"ckptdelta {argv[0]}" if argv[0] in COMMANDS else "ckptdelta"
    ok = rc == want_rc and needle in line and line.startswith(f"{prog}: error: ") and "Traceback" not in err
    if want_rc == 2:
        ok = ok and line.endswith(f"(see {prog} --help)")
    if "--storage-timeout" in argv:   # bounded, and the retries said nothing at the default verbosity
        bound = float(argv[argv.index("--storage-timeout") + 1])
        ok = ok and seconds < bound + slack and err.count("\n") == 1
    return None if ok else f"{argv}: exit {rc} after {seconds:.1f}s, stderr {err[-600:]!r}"


def test_the_console_script_fails_in_one_line_fast(runs):
    """The cases of the issue, through the installed ``ckptdelta`` (a few at a time: each imports torch)."""
    s3_dead = ["--storage-option", f"client_kwargs.endpoint_url=http://127.0.0.1:{free_port()}",
               "--storage-option", "key=k", "--storage-option", "secret=s"]
    cases = [  # argv, exit status, what the first line of stderr says
        (["ls", "foo://x/y"], 1, "ckptdelta ls: error: foo://x/y: unknown storage protocol 'foo'"),
        (["serve", "--model", "./nodir"], 1, "ckptdelta serve: error: model directory ./nodir does not exist"),
        (["ls", "s3://bucket/run", *s3_dead, "--storage-timeout", "2"], 1, "failed within the 2 s storage timeout"),
    ]
    if not torch.cuda.is_available():   # checked before anything is downloaded: the run is not even opened
        cases.append((["serve", "--bucket", "foo://never/opened", "--device", "cuda"], 1, "no usable CUDA device"))
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda c: ckptdelta(*c[0]), cases))
    problems = [_check(*case, rc, err, seconds) for case, (rc, _out, err, seconds) in zip(cases, results)]
    assert not any(problems), "\n".join(p for p in problems if p)


def test_every_command_says_a_mistake_in_one_line_with_the_right_exit_status(runs, tmp_path, capsys):
    """Item 4's audit, every subcommand, in this process (the console script's own code path: main)."""
    dead = free_port()
    busy = _silent_server()
    silent = _silent_server()
    gs_silent = ["--storage-option", f"endpoint_url=http://127.0.0.1:{silent.getsockname()[1]}",
                 "--storage-option", "token=anon"]
    nonempty = tmp_path / "full"
    nonempty.mkdir()
    (nonempty / "x").write_text("x")
    cases = [
        (["publish", "./nodir", runs["servable"], "--step", "1"], 1, "./nodir: no such file or directory"),
        (["publish", runs["root"], runs["servable"]], 2, "the following arguments are required: --step"),
        (["publish", runs["root"], runs["servable"], "--step", "-1"], 2, "argument --step: -1 is below 0"),
        (["publish", runs["root"], runs["servable"], "--step", "1", "--metadata", "x"], 2, "--metadata takes K=V"),
        (["ls", runs["servable"], "--storage-options", "[1]"], 2, "--storage-options must be a JSON object"),
        (["ls", runs["servable"], "--storage-timeout", "-1"], 2, "--storage-timeout -1: must be >= 0"),
        (["ls", str(tmp_path / "typo")], 1, "no run at"),
        (["gc", runs["servable"], "--keep-anchors", "0"], 2, "argument --keep-anchors: 0 is below 1"),
        (["gc", "foo://x"], 1, "unknown storage protocol"),
        (["serve", "--bucket", runs["bare"]], 1, "carries no config.json and no tokenizer files"),
        (["serve", "--bucket", runs["config-only"]], 1, "carries no tokenizer files"),
        (["serve", "--engine", "vllm", "--bucket", runs["config-only"]], 1, "extra_files=MODEL_DIR"),
        (["serve", "--model", runs["root"]], 1, "holds no config.json and no tokenizer files"),
        (["serve", "--bucket", runs["servable"], "--port", str(busy.getsockname()[1])], 1, "cannot listen on"),
        (["serve", "--bucket", runs["servable"], "--device", "nonsense"], 2, "is not a torch device"),
        (["serve", "--bucket", runs["servable"], "--snapshot", "7"], 1, "no committed snapshot v00000007"),
        (["hotload", f"http://127.0.0.1:{dead}", "latest"], 1, "unreachable"),
        (["materialize", runs["servable"], "v00000099", str(tmp_path / "out")], 1, "no committed snapshot"),
        (["materialize", runs["servable"], "latest", str(nonempty)], 1, "exists and is not empty"),
        (["verify", runs["servable"], "../x"], 1, "no snapshot named '../x'"),
        (["verify", "gs://bucket/run", *gs_silent, "--storage-timeout", "1"], 1, "within the 1 s storage timeout"),
        (["inspect", str(tmp_path / "none.ckd")], 1, "no such file"),
        (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
        ([], 2, "give a command"),
    ]
    problems = []
    try:
        for argv, want_rc, needle in cases:
            t0 = time.monotonic()
            try:
                rc = main(argv)
            except SystemExit as e:   # argparse's own errors
                rc = e.code
            problems.append(_check(argv or ["(none)"], want_rc, needle, rc, capsys.readouterr().err,
                                   time.monotonic() - t0, slack=3.0))
    finally:
        busy.close()
        silent.close()
    assert not any(problems), "\n".join(p for p in problems if p)
    assert main(["-v", "ls", "foo://x/y"]) == 1                       # -v: the traceback, then the line
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("ckptdelta ls: error: foo://x/y")


# --- item 5: storage timeouts, from Python ----------------------------------------------------------------

def test_the_storage_timeout_bounds_an_operation_and_comes_from_the_environment(monkeypatch):
    silent = _silent_server()
    opts = {"token": "anon", "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}"}
    try:
        store = Store.from_url("gs://bucket/run", opts, retry=RetryPolicy(timeout=1.0))
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="1 s storage timeout"):
            store.get("RUN.json")
        assert time.monotonic() - t0 < 5
    finally:
        silent.close()
    assert RetryPolicy().timeout == 60.0
    monkeypatch.setenv("CKPTDELTA_STORAGE_TIMEOUT", "7.5")
    assert RetryPolicy().timeout == 7.5
    monkeypatch.setenv("CKPTDELTA_STORAGE_TIMEOUT", "0")
    assert RetryPolicy().timeout is None


# --- item 9: a publish that changes tensors says what replicas will do -----------------------------------

def test_a_publish_that_changes_shapes_warns_on_the_console_and_in_the_log(tmp_path, caplog, capsys):
    import safetensors.torch

    url = str(tmp_path / "run")
    w = weights()
    with Publisher(url, progress=False) as pub:
        pub.publish(w, 0)
        with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"):
            r = pub.publish(w, 1)
            assert r.schema_change == "" and not caplog.records
            grown = dict(w, **{name: torch.zeros(3, 3) for name in list(w)[:1]})
            r = pub.publish(grown, 2)
    assert r.kind == "anchor" and "dtype/shape changed" in r.schema_change
    (msg,) = [x.getMessage() for x in caplog.records]
    assert "ShapeMismatchError" in msg and "ckptdelta serve --snapshot v00000002" in msg and "docs/" in msg
    caplog.clear()
    src = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(5)}, str(src))
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"):
        assert main(["publish", str(src), url, "--step", "3"]) == 0
    assert "tensors changed: added 'x'" in capsys.readouterr().out      # the result line gives the reason
    assert any("ShapeMismatchError" in x.getMessage() for x in caplog.records)


# --- item 10 ---------------------------------------------------------------------------------------------

def test_help_shows_the_defaults(capsys):
    for argv, needles in ((["serve", "--help"], ["default: 127.0.0.1", "default: 8000", "default: cpu",
                                                 "default: recompute", "default: 60"]),
                          (["gc", "--help"], ["default: 3600", "newest K anchors", "(default: 2)"])):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert all(n in out for n in needles), (argv, out)


def test_ls_shows_an_anchors_weights_and_extra_files_apart(runs, capsys):
    assert main(["ls", runs["servable"]]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert "weights" in header and "extra files" in header
    assert main(["ls", runs["servable"], "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["weights_bytes"] + r["extra_bytes"] == r["stored_bytes"] and r["extra_bytes"] > 0
    assert r["ratio"] == r["weights_bytes"] / r["full_bytes"]     # the shard and its header, without the extras
    assert f"{100 * r['ratio']:.2f}%" in row and f"{100 * r['stored_bytes'] / r['full_bytes']:.2f}%" not in row


def test_a_names_filter_that_matches_nothing_says_so(runs, caplog):
    r = SnapshotReader(runs["servable"])
    with caplog.at_level(logging.WARNING, logger="ckptdelta.loader"):
        assert r.read_tensors(0, names=lambda n: n.startswith("model.layers.0.")) == {}
    (msg,) = [x.getMessage() for x in caplog.records]
    assert "matched none of its" in msg and "named like" in msg
