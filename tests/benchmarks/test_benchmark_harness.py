"""benchmarks/harness.py, what every benchmark shares: the formatters of the tables' cells, a run's files written
and rendered again from its JSON, the peer process's protocol (real child processes), and the helpers with
logic of their own. The benchmarks' own runs are the other tests' (tests/benchmarks/test_*benchmark*.py)."""

from __future__ import annotations

import argparse
import array
import contextlib
import fcntl
import io
import json
import os
import shutil
import sys
import termios
import time

import pytest

from benchmarks import harness
from tests import REPO

RESULTS = os.path.join(REPO, "benchmarks", "results")


def test_unit_formatters_change_unit_and_precision_at_their_thresholds():
    assert (harness.ms(0.01234), harness.ms(0.01234, 0), harness.ms(2.0)) == ("12.3", "12", "2000.0")
    assert [harness.seconds(x) for x in (1.234, 0.1, 0.0999, 0.045)] == ["1.23", "0.10", "100 ms", "45 ms"]
    assert [harness.duration(x) for x in (4.5e-5, 0.001, 0.0045, 0.01, 0.045, 1.0, 12.345)] == \
        ["45 us", "1.0 ms", "4.5 ms", "10 ms", "45 ms", "1.00 s", "12.35 s"]
    assert [harness.mb(x) for x in (12_345_678, 1e5, 99_999, 1234)] == ["12.3", "0.1", "0.100", "0.001"]
    assert harness.mb(1_234_567, 2) == "1.23"
    assert [harness.nbytes(x) for x in (512, 999, 1000, 1536, 12e6, 3.2e9, 5e12)] == \
        ["512 B", "999 B", "1.0 KB", "1.5 KB", "12.0 MB", "3.2 GB", "5000.0 GB"]
    assert [harness.bitrate(x) for x in (1e7, 5e8, 1e9, 2.5e9)] == ["10 Mbit/s", "500 Mbit/s", "1 Gbit/s",
                                                                     "2.5 Gbit/s"]
    assert (harness.value(0.1234, "s"), harness.value(None, "s"), harness.value(2, "GB", 1)) == \
        ("0.123 s", "-", "2.0 GB")


def test_a_link_flag_reads_as_bits_per_second_and_one_it_cannot_read_is_the_flags_error(capsys):
    assert [harness.parse_bitrate(s) for s in ("1gbit", "500mbit", "2.5Gbit", "10kbit", "fast")] == \
        [1e9, 5e8, 2.5e9, 1e4, None]
    p = argparse.ArgumentParser()
    p.add_argument("--link", type=harness.parse_bitrate)
    assert p.parse_args(["--link", "100mbit"]).link == 1e8
    with pytest.raises(SystemExit):
        p.parse_args(["--link", "1gb"])
    assert "link '1gb': expected e.g. 1gbit, 500mbit or fast" in capsys.readouterr().err


def test_the_shared_flags_are_added_under_each_benchmarks_own_names():
    p = harness.parser("x", "What it measures.\n\nMore.", quick="smoke", from_json="render again", s3=True)
    a = p.parse_args([])
    assert (a.quick, a.out_dir, a.from_json, a.s3_url, a.storage_options) == (False, harness.RESULTS, None, None, None)
    a = p.parse_args(["--quick", "--out-dir", "d", "--from-json", "r.json", "--storage-options", '{"anon": true}'])
    assert (a.quick, a.out_dir, a.from_json, a.storage_options) == (True, "d", "r.json", {"anon": True})
    assert p.prog == "python -m benchmarks.x" and p.description == "What it measures."
    p = harness.parser("y", "Doc.", out="--out", from_json="again", from_json_flag="--render")
    a = p.parse_args(["--out", "d", "--render", "r.json"])
    assert (a.out, a.render) == ("d", "r.json") and not hasattr(a, "quick") and not hasattr(a, "s3_url")
    assert not hasattr(harness.parser("z", "Doc.", out=None).parse_args([]), "out_dir")


def test_a_run_writes_its_table_json_and_plot_and_prints_the_table_last(tmp_path, capsys):
    drawn = []
    harness.write(str(tmp_path / "sub" / "run"), "| a |\n", {"rows": [1, (2, 3)]},
                  lambda path: drawn.append(path) or open(path, "wb").close())
    assert capsys.readouterr().out == "\n| a |\n\n"
    assert (tmp_path / "sub" / "run.md").read_text() == "| a |\n"
    assert harness.read_json(str(tmp_path / "sub" / "run.json")) == {"rows": [1, [2, 3]]}
    assert drawn == [str(tmp_path / "sub" / "run.png")]
    harness.write(str(tmp_path / "quiet"), "| b |\n", echo=False)          # only what is given
    assert capsys.readouterr().out == "" and sorted(os.listdir(tmp_path)) == ["quiet.md", "sub"]


def test_a_run_rendered_again_from_the_json_it_wrote_gives_the_same_table_json_and_plot(tmp_path):
    """benchmarks.lora --from-json of its run of record, then --from-json of the JSON that wrote: every file the
    same bytes (the JSON a run writes holds all its table and plot are made of, and reads back as it was; the
    other benchmarks with --from-json write and read theirs through the same two functions)."""
    from benchmarks import lora

    src = tmp_path / "lora.json"
    shutil.copy(os.path.join(RESULTS, "lora.json"), src)
    for out, json_in in (("first", src), ("second", tmp_path / "first" / "lora.json")):
        with contextlib.redirect_stdout(io.StringIO()):
            assert lora.main(["--from-json", str(json_in), "--out-dir", str(tmp_path / out)]) == 0
    for ext in ("md", "json", "png"):
        first, second = (tmp_path / d / f"lora.{ext}" for d in ("first", "second"))
        assert first.read_bytes() == second.read_bytes(), ext
    assert "## Targets" in (tmp_path / "first" / "lora.md").read_text()
    assert (tmp_path / "first" / "lora.png").stat().st_size > 10_000


def test_a_plot_that_fails_leaves_no_file_and_no_open_figure(tmp_path):
    plt = harness.pyplot()
    before = plt.get_fignums()
    with pytest.raises(KeyError):
        with harness.figure(str(tmp_path / "p.png"), 1, 2) as (_, axes):
            axes[0].plot([1, 2])
            raise KeyError("a field the run did not record")
    assert plt.get_fignums() == before and not (tmp_path / "p.png").exists()
    with harness.figure(str(tmp_path / "q.png"), figsize=(2, 2), dpi=50) as (_, ax):
        ax.plot([1, 2])
    assert plt.get_fignums() == before and (tmp_path / "q.png").stat().st_size > 0


_NODE = """
import sys
from benchmarks.harness import serve

class Node:
    def op_add(self, a, b):
        print("library chatter on stdout")     # must reach the log, not the protocol
        return {"sum": a + b}

    def op_fail(self, what):
        raise ValueError(f"cannot {what}")

    def op_drop(self):
        open(sys.argv[1], "w").write("dropped")

serve(Node(), hello={"ok": True, "ready": "node"})
"""


def _until_unread(peer: harness.Peer, n: int) -> None:
    """Until ``n`` bytes of answers wait unread in the peer's stdout pipe (the kernel's count, FIONREAD)."""
    deadline = time.monotonic() + 120
    count = array.array("i", [0])
    while True:
        fcntl.ioctl(peer.proc.stdout.fileno(), termios.FIONREAD, count)
        if count[0] >= n:
            return
        assert time.monotonic() < deadline, f"{count[0]} of {n} bytes of answers"
        time.sleep(0.01)


def test_a_peer_answers_each_command_in_turn_names_itself_in_an_error_and_drops_its_state_on_exit(tmp_path):
    marker = tmp_path / "dropped"
    peer = harness.Peer("peer n0", [sys.executable, "-c", _NODE, str(marker)], str(tmp_path / "n0.log"),
                        timeout=120)
    try:
        assert peer.recv() == {"ready": "node"}
        assert peer.call("add", a=2, b=3) == {"sum": 5}
        peer.send("add", a=1, b=1)                       # sent ahead, answered in order
        peer.send("add", a=4, b=5)
        _until_unread(peer, sum(len(json.dumps({"ok": True, "sum": x})) + 1 for x in (2, 9)))
        assert [peer.recv()["sum"], peer.recv()["sum"]] == [2, 9]     # both lines came in one read
        with pytest.raises(RuntimeError, match=r"^peer n0: ValueError: cannot divide\n.*Traceback") as e:
            peer.call("fail", what="divide")
        assert "op_fail" in str(e.value)                 # the peer's own trace
        assert peer.call("add", a=1, b=2) == {"sum": 3}  # an error leaves the peer serving
    finally:
        peer.close()
    assert peer.proc.returncode == 0 and marker.read_text() == "dropped"
    assert "library chatter on stdout" in (tmp_path / "n0.log").read_text()


def test_a_peer_that_exits_or_stays_silent_is_reported_with_its_log_tail(tmp_path):
    dead = harness.Peer("replica", [sys.executable, "-c", "import sys; sys.stderr.write('no bucket at s3://x'); "
                                                          "sys.exit(3)"], str(tmp_path / "dead.log"))
    assert dead.proc.wait(timeout=120) == 3
    with pytest.raises(RuntimeError, match=r"^replica: no answer \(exited\); log tail:\nno bucket at s3://x$"):
        dead.recv()
    mute = harness.Peer("trainer", [sys.executable, "-c", "import sys, time; sys.stderr.write('loading'); "
                                                          "sys.stderr.flush(); time.sleep(600)"],
                        str(tmp_path / "mute.log"))
    try:
        with pytest.raises(RuntimeError, match=r"^trainer: no answer \(timeout\); log tail:\n"):
            mute.call("init", timeout=0.5)
    finally:
        mute.close(timeout=0.5)                          # it reads no command: killed
    assert mute.proc.returncode is not None


def test_repeated_samples_become_one_row_of_medians_flags_all_true_and_the_samples_kept():
    samples = [{"pause_s": 3.0, "bytes": 10, "exact": True, "kind": "delta"},
               {"pause_s": 1.0, "bytes": 30, "exact": False, "kind": "anchor"},
               {"pause_s": 2.0, "bytes": 20, "exact": True, "kind": "delta"}]
    row = harness.median_sample(samples)
    assert row == {"pause_s": 2.0, "bytes": 20, "exact": False, "kind": "delta", "samples": samples}
    assert harness.medians(samples, ("pause_s", "bytes")) == {"pause_s": 2.0, "bytes": 20}


def test_the_command_a_table_quotes_leaves_out_where_the_files_went():
    assert harness.command("lora", ["--steps", "5", "--out-dir", "/somewhere", "--dtype", "bf16"]) == \
        "python -m benchmarks.lora --steps 5 --dtype bf16"
    assert harness.command("lora_codec", []) == "python -m benchmarks.lora_codec"


def test_a_log_tail_is_the_end_of_the_file_and_nothing_when_there_is_none(tmp_path):
    (tmp_path / "log").write_bytes(b"x" * 5000 + b"the error")
    assert harness.tail(str(tmp_path / "log"), 9) == "the error" and len(harness.tail(str(tmp_path / "log"))) == 3000
    assert harness.tail(str(tmp_path / "missing")) == ""
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_bytes(b"12345")
    assert harness.du(str(tmp_path / "d")) == 5 and harness.du(str(tmp_path / "nothing")) == 0
