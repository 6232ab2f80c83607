"""Smoke test of benchmarks/publish_cpu.py: a quick run through a real S3 API (rclone serve s3 on 127.0.0.1) writes
its table, JSON and plot, and accounts for each publish's CPU by thread. No timing is asserted."""

from __future__ import annotations

import json
import threading

import pytest


@pytest.mark.parametrize("dtype, name", [("bf16", "publish_cpu-quick"), ("fp32", "publish_cpu-fp32-quick")])
def test_a_quick_publish_cpu_run_splits_each_publishs_cpu_by_thread_and_writes_markdown_json_and_png(tmp_path, dtype,
                                                                                                     name):
    """Each dtype's run has files of its own: an fp32 run does not overwrite the bf16 one's results."""
    from benchmarks import publish_cpu

    assert publish_cpu.main(["--quick", "--dtype", dtype, "--out-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [f"{name}.{e}" for e in ("json", "md", "png")]
    out = json.loads((tmp_path / f"{name}.json").read_text())
    assert out["meta"]["dtype"] == dtype
    (row,) = out["rows"]
    assert row["rank"] == 16 and len(row["samples"]) == 3
    for s in row["samples"]:
        assert s["kind"] == "delta" and s["parts"] >= 1 and s["stored_bytes"] > 0
        roles = s["roles"]
        # every request went through fsspec's loop thread, and the encode ran on the publish thread
        assert roles["S3 client (fsspec loop)"] > 0 and roles["publish thread"] > 0
        assert sum(roles.values()) == pytest.approx(s["cpu_s"], abs=1e-9)     # "other" closes the sum
    md = (tmp_path / f"{name}.md").read_text()
    assert f"({dtype} adapters)" in md and "| rank | MB / delta | parts |" in md and "S3 client (fsspec loop)" in md
    assert (tmp_path / f"{name}.png").stat().st_size > 5_000


def test_thread_cpu_counts_a_busy_thread_under_its_role():
    from benchmarks.publish_cpu import thread_cpu

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="ckptdelta-codec_9")
    before = thread_cpu()
    t.start()
    try:
        stop.wait(0.3)
        during = thread_cpu()
    finally:
        stop.set()
        t.join()
    assert during.get("codec threads", 0.0) - before.get("codec threads", 0.0) > 0.05


def test_the_rclone_the_benchmarks_pin_is_the_one_make_test_installs():
    import tomllib
    from pathlib import Path

    from benchmarks import s3disk

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert s3disk.RCLONE_PIN in project["project"]["optional-dependencies"]["bench"]
