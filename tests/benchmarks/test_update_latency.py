"""Smoke test of benchmarks/update_latency.py: the quick mode runs end to end and writes its report.

No timing is asserted (the numbers depend on the machine); what must hold is that
every path it times ends with the live weights bit-exact to the trainer's.
"""

from __future__ import annotations

import json

from benchmarks import update_latency


def test_quick_run_swaps_bit_exact_and_writes_markdown_json_and_png(tmp_path, capsys):
    assert update_latency.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "update_latency-quick.md").read_text()
    assert "| local |" in md and "full / ckptdelta" in md
    assert (tmp_path / "update_latency-quick.png").stat().st_size > 0
    report = json.loads((tmp_path / "update_latency-quick.json").read_text())
    (r,) = report["results"]
    assert r["backend"] == "local" and 0.01e9 < r["model_bytes"] < 0.04e9
    for step in ("delta", "sparse", "full"):
        assert r[step]["bit_exact"] is True
    d, sparse = r["delta"], r["sparse"]
    # the hot-load wrote the elements the step changed (a sparse one exactly those); the delta is small
    assert d["elements_changed"] >= d["elements_changed_expected"] > 0
    assert sparse["elements_changed"] == sparse["elements_changed_expected"] > 0
    assert sparse["elements_changed"] < d["elements_changed"]
    assert d["kind"] == sparse["kind"] == "delta" and 0 < d["stored_bytes"] < r["model_bytes"] / 10
    assert r["full"]["stored_bytes"] >= r["model_bytes"]
    for k in update_latency.DELTA_PARTS:
        assert d[k] >= 0
    # the pause beside a full copy of the model, measured in the same run, at each share of changes swept
    assert [x["fraction"] for x in r["sweep"]] == list(update_latency.QUICK_SWEEP)
    for x in r["sweep"]:
        assert x["bit_exact"] is True and x["model_copy_s"] > 0 and x["pause_over_copy"] > 0
        assert len(x["model_copy_samples"]) == 2 * len(x["samples"])   # one right before, one right after each
        assert x["elements_changed"] == x["elements_changed_expected"] > 0
        # the floor beside it: the same changes scattered bare, after the commit (bit_exact is checked after it)
        assert x["floor_s"] > 0 and x["floor_over_copy"] > 0
        assert 0 < x["lines_share"] <= 1
    assert "**pause / copy**" in md and "a full copy of the model" in md and "bare scatter / copy" in md
    assert "ckptdelta" in capsys.readouterr().out


def test_lines_share_counts_the_cache_lines_that_hold_a_change():
    import numpy as np
    import torch

    buf = torch.zeros(64 * 1024 + 32, dtype=torch.uint8)
    skew = (-buf.data_ptr()) % 64
    t = buf[skew:skew + 64 * 1024].view(torch.bfloat16)       # 1024 lines of 32 elements, line-aligned
    every_line = np.arange(0, 32 * 1024, 32)
    assert update_latency._lines_share({"t": t}, {"t": every_line}) == 1.0
    one_line = np.arange(32, 64)                              # a whole line, and nothing else
    assert update_latency._lines_share({"t": t}, {"t": one_line}) == 1 / 1024
    assert update_latency._lines_share({"t": t}, {"t": np.arange(16, 48)}) == 2 / 1024   # straddles two
    w = buf[skew + 2:skew + 2 + 64 * 8].view(torch.bfloat16)  # starts 2 bytes into a line: spans 9 lines
    assert update_latency._lines_share({"w": w}, {"w": np.array([31])}) == 1 / 9           # byte 62 + 2 = 64
    assert update_latency._lines_share({"t": t, "w": w}, {"t": np.arange(0), "w": np.array([30])}) == 1 / 1033


def test_hot_load_and_publish_show_progress_bars_when_asked_and_stay_quiet_otherwise(tmp_path, capfd):
    import torch

    from ckptdelta.loader import HotSwapper, SnapshotReader
    from ckptdelta.publisher import Publisher

    w = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64).to(torch.bfloat16)}
    live = {"w": w["w"].clone()}
    url = str(tmp_path / "run")
    for progress in (False, True):
        with Publisher(url, progress=progress) as pub:
            version = pub.publish(w, 2 * progress).version
            w["w"][0, :8] += 1
            swapper = HotSwapper(live, SnapshotReader(url), version=version, progress=progress)
            swapper.hotload(pub.publish(w, 2 * progress + 1).version)
        err = capfd.readouterr().err
        assert ("hot-load v" in err) is progress and ("delta v" in err) is progress
        assert torch.equal(live["w"].view(torch.int16), w["w"].view(torch.int16))
