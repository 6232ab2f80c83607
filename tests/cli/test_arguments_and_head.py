"""The console script's arguments (ranges, which flags go together, names and help) and ``verify`` of a run
whose HEAD is damaged, each through the real ``ckptdelta`` against a local-directory bucket.

The ``ckptdelta`` processes run a few at a time: each one pays for importing torch.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from ckptdelta.cli import build_parser
from ckptdelta.delta.manifest import HEAD_KEY, MAX_HEAD_BYTES, Head, manifest_key
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from tests.cli.test_first_hour import ckptdelta, first_line


def _publish(url: str, versions: int) -> None:
    w = torch.zeros(64, 8)
    with Publisher(url, progress=False) as pub:
        for step in range(versions):
            w = w + (torch.arange(w.numel()).view_as(w) % (7 + step) == 0).float()
            pub.publish({"w": w, "b": torch.arange(8, dtype=torch.float32) + step}, step)


@pytest.fixture(scope="module")
def run3(tmp_path_factory) -> str:
    """A run of three versions (an anchor, two deltas); tests that damage it put it back."""
    url = str(tmp_path_factory.mktemp("args") / "bucket" / "run")
    _publish(url, 3)
    return url


def _all(cases: list[list[str]]) -> list[tuple[int, str, str, float]]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda argv: ckptdelta(*argv), cases))


def _usage_problems(cases: list[tuple[list[str], str]]) -> list[str]:
    """What is wrong with each case that should be one usage-error line naming ``needle``, exit 2."""
    problems = []
    for (argv, needle), (rc, _out, err, _s) in zip(cases, _all([argv for argv, _ in cases])):
        line = first_line(err)
        prog = f"ckptdelta {argv[0]}"
        if not (rc == 2 and line.startswith(f"{prog}: error: ") and needle in line
                and line.endswith(f"(see {prog} --help)") and err.count("\n") == 1 and "Traceback" not in err):
            problems.append(f"{argv}: exit {rc}, stderr {err[-400:]!r} (wanted exit 2 and {needle!r})")
    return problems


# --- 1. numbers out of range are usage errors, before anything runs -------------------------------------

def test_numeric_options_out_of_range_are_one_line_usage_errors_with_exit_status_2(run3, tmp_path):
    model = str(tmp_path / "no-model")     # never looked at: the parser refuses first
    cases = [
        (["gc", run3, "--grace-seconds", "-1", "--dry-run"], "argument --grace-seconds: -1 is below 0"),
        (["gc", run3, "--grace-seconds", "nan", "--dry-run"], "argument --grace-seconds: 'nan' is not a finite"),
        (["serve", "--model", model, "--port", "99999"], "argument --port: 99999 is above 65535"),
        (["serve", "--model", model, "--port", "-1"], "argument --port: -1 is below 0"),
        (["serve", "--model", model, "--drain-timeout", "-1"], "argument --drain-timeout: -1 is below 0"),
        (["serve", "--model", model, "--cache-max-gb", "-1"], "argument --cache-max-gb: -1 is below 0"),
        (["serve", "--model", model, "--cache-max-gb", "inf"], "argument --cache-max-gb: 'inf' is not a finite"),
        (["serve", "--model", model, "--lora-slots", "1"], "argument --lora-slots: 1 is below 2"),
        (["serve", "--model", model, "--request-timeout", "0"], "argument --request-timeout: 0 is not above 0"),
        (["serve", "--model", model, "--control-timeout", "x"], "argument --control-timeout: 'x' is not a number"),
        (["hotload", "http://127.0.0.1:9", "latest", "--await-commit", "5000"],
         "argument --await-commit: 5000 is above 3600"),
        (["hotload", "http://127.0.0.1:9", "latest", "--await-commit", "0"],
         "argument --await-commit: 0 is not above 0"),
    ]
    problems = _usage_problems(cases)
    assert not problems, "\n".join(problems)
    assert len(SnapshotReader(run3).versions()) == 3          # gc did nothing


def test_numeric_options_take_every_value_in_range_including_the_bounds():
    parser = build_parser()
    args = parser.parse_args(["gc", "URL", "--grace-seconds", "0"])
    assert args.grace_seconds == 0
    args = parser.parse_args(["serve", "--port", "65535", "--drain-timeout", "0", "--cache-max-gb", "0",
                              "--lora-slots", "2", "--request-timeout", "0.5", "--control-timeout", "1"])
    assert (args.port, args.drain_timeout, args.cache_max_gb, args.lora_slots) == (65535, 0, 0, 2)
    assert (args.request_timeout, args.control_timeout) == (0.5, 1)
    assert parser.parse_args(["serve", "--port", "0"]).port == 0     # 0: a free port
    assert parser.parse_args(["hotload", "U", "latest", "--await-commit", "3600"]).await_commit == 3600
    defaults = parser.parse_args(["serve"])
    assert (defaults.port, defaults.drain_timeout, defaults.cache_max_gb, defaults.lora_slots) == (8000, None, None, 3)


# --- 2. --snapshot names a snapshot of --bucket: refused where the replica does not start from one ---------

def test_serve_refuses_a_snapshot_it_would_not_start_from(run3, tmp_path):
    model = str(tmp_path / "no-model")
    problems = _usage_problems([
        (["serve", "--model", model, "--snapshot", "1"], "--snapshot 1 names a snapshot of a run: give --bucket"),
        (["serve", "--model", model, "--bucket", run3, "--snapshot", "1"], "--snapshot 1 with --model"),
    ])
    assert not problems, "\n".join(problems)


def test_serve_with_a_bucket_starts_from_the_snapshot_named_and_latest_by_default(run3, tmp_path):
    """--snapshot keeps its meaning with --bucket: the version resolved and checked is the one named (this
    run carries no config.json, so the check that follows the resolve fails, naming the version it reached)."""
    cases = [["serve", "--bucket", run3, "--port", "0", "--snapshot", "7"],
             ["serve", "--bucket", run3, "--port", "0", "--snapshot", "1"],
             ["serve", "--bucket", run3, "--port", "0"]]
    (rc7, _, err7, _), (rc1, _, err1, _), (rc_latest, _, err_latest, _) = _all(cases)
    assert rc7 == 1 and "no committed snapshot v00000007" in err7, err7
    assert rc1 == 1 and "v00000001" in err1 and "carries no config.json" in err1, err1
    assert rc_latest == 1 and "v00000002" in err_latest and "carries no config.json" in err_latest, err_latest


# --- 3. verify and a damaged HEAD: HEAD is a hint ------------------------------------------------------

def _head_of_another_run(url: str) -> bytes:
    with open(os.path.join(url, manifest_key(2)), "rb") as f:
        return Head("another-run", 2, xxhash.xxh3_64(f.read()).hexdigest()).to_json()


@pytest.mark.parametrize("damage", ["not-json", "another-run", "oversized"])
def test_verify_checks_an_explicit_version_despite_a_damaged_head_and_reports_the_head_on_its_own(run3, damage):
    from ckptdelta.loader.verify import HeadPointerError

    path = os.path.join(run3, HEAD_KEY)
    with open(path, "rb") as f:
        original = f.read()
    bad = {"not-json": lambda: b"{not json\n", "another-run": lambda: _head_of_another_run(run3),
           "oversized": lambda: b" " * (MAX_HEAD_BYTES + 1)}[damage]()      # larger than a HEAD may be
    try:
        with open(path, "wb") as f:
            f.write(bad)
        (rc1, out1, err1, _), (rc2, out2, err2, _), (rc_latest, out_latest, err_latest, _) = _all(
            [["verify", run3, "1"], ["verify", run3, "v00000002"], ["verify", run3]])
        for rc, out, err, name, chain in ((rc1, out1, err1, "v00000001", "v0..v1"),
                                          (rc2, out2, err2, "v00000002", "v0..v2")):
            assert out.startswith(f"ok: {name} of run ") and f"(chain {chain}" in out, out   # verified whole
            assert rc == 1 and err.count("\n") == 1, err                                       # ... and HEAD said
            assert err.startswith("ckptdelta verify: error: ") and "/HEAD" in err, err
            assert f"{name} itself verified" in err and "rewrite or delete HEAD" in err, err
        # latest is found through HEAD: nothing is verified, and the one line says how to repair it
        assert rc_latest == 1 and out_latest == "" and err_latest.count("\n") == 1, err_latest
        assert "/HEAD" in err_latest and "rewrite or delete HEAD" in err_latest, err_latest
        # the library: the chain was checked whole before the HEAD was reported, and the report says so
        with pytest.raises(HeadPointerError, match="rewrite or delete HEAD") as e:
            SnapshotReader(run3).verify(1, progress=False)
        assert e.value.report is not None and e.value.report.version == 1 and e.value.report.chain == [0, 1]
        assert e.value.report.tensors_checked == 4
        with pytest.raises(HeadPointerError) as e:
            SnapshotReader(run3).verify(progress=False)
        assert e.value.report is None
        os.remove(path)           # the repair the message names: without HEAD, readers list the manifests
        rc, out, err, _ = ckptdelta("verify", run3)
        assert rc == 0 and out.startswith("ok: v00000002 of run ") and err == "", err
    finally:
        with open(path, "wb") as f:
            f.write(original)


def test_verify_of_an_intact_run_passes_with_nothing_on_stderr(run3):
    (rc, out, err, _), (rc_latest, out_latest, err_latest, _) = _all([["verify", run3, "1"], ["verify", run3]])
    assert rc == 0 and out.startswith("ok: v00000001 of run ") and err == "", err
    assert rc_latest == 0 and out_latest.startswith("ok: v00000002 of run ") and err_latest == "", err_latest


# --- 5. names and help of positional arguments; counts of one ----------------------------------------------

def test_every_positional_argument_has_help_and_an_upper_case_name():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    problems = []
    for cmd, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings:
                continue
            name = action.metavar or action.dest
            if not action.help:
                problems.append(f"{cmd} {name}: no help")
            if name.replace(".ckd", "") != name.upper().replace(".CKD", ""):   # inspect's FILE.ckd
                problems.append(f"{cmd} {name}: not upper case like URL and SNAPSHOT")
    assert not problems, problems


def test_materialize_and_verify_usage_name_url_and_snapshot_in_upper_case():
    (rc_m, out_m, _, _), (rc_v, out_v, _, _) = _all([["materialize", "--help"], ["verify", "--help"]])
    assert rc_m == 0 and "URL SNAPSHOT OUT_DIR" in " ".join(out_m.split()), out_m
    assert rc_v == 0 and "URL [SNAPSHOT]" in out_v, out_v


def test_a_count_of_one_is_said_in_the_singular(tmp_path):
    url = str(tmp_path / "bucket" / "one")
    with Publisher(url, progress=False) as pub:
        pub.publish({"w": torch.ones(16)}, 0)
    (rc_v, out_v, err_v, _), (rc_i, out_i, err_i, _), (rc_g, out_g, err_g, _) = _all(
        [["verify", url], ["inspect", url, "0"], ["gc", url, "--dry-run"]])
    assert rc_v == 0 and "(chain v0..v0, 1 version): 1 object, 1 tensor digest, " in out_v, out_v + err_v
    assert rc_i == 0 and out_i.splitlines()[1].startswith("1 object, ") and "; 1 tensor stored" in out_i, out_i + err_i
    assert rc_g == 0 and out_g.startswith("kept 1 snapshot; would delete 0 manifests and 0 objects"), out_g + err_g
