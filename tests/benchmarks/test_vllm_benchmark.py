"""Smoke test of benchmarks/vllm_hotload.py: the quick mode runs against a real vLLM and writes its report.

One vLLM start (~22 s on two cores, its worker in the engine core as in
tests.vllm_replicas). No timing is asserted (the numbers depend on the machine);
what must hold is that every method measured its rows and every swap ended with
vLLM's live weights equal to the published ones (worker read-back digests of
every tensor).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import vllm_hotload
from tests.vllm_replicas import use_one_gpu_layout


@pytest.mark.slow   # a benchmark's quick run (~50 s): make stress, beside make bench; the suite is near its CI limit
def test_quick_run_measures_every_method_verifies_every_swap_and_writes_markdown_json_and_png(tmp_path, capsys,
                                                                                           monkeypatch):
    use_one_gpu_layout(monkeypatch)   # the demo's test keeps vLLM's CPU layout (a worker process)
    assert vllm_hotload.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "vllm_hotload-quick.md").read_text()
    for label in vllm_hotload.LABELS.values():
        assert f"| {label} |" in md
    assert "Targets:" in md and "tokens/s while a hot-load prepares" in md
    assert (tmp_path / "vllm_hotload-quick.png").stat().st_size > 0
    out = json.loads((tmp_path / "vllm_hotload-quick.json").read_text())
    assert out["verified"] is True and out["meta"]["warm_up_verified"] is True
    assert set(out["methods"]) == set(vllm_hotload.METHODS)
    for name in vllm_hotload.METHODS:
        row = out["methods"][name]
        assert row["samples"] and all(s["verified"] is True for s in row["samples"]), name
        assert row["pause_s"] > 0 and row["publish_to_serving_s"] >= row["pause_s"] and row["bytes"] > 0, name
        assert set(out["ratios"][name]) == {"pause_vs_full_reload", "publish_to_serving_vs_full", "bytes_vs_full"}
    assert len(out["methods"]["ckptdelta"]["samples"]) == 3
    # the ckptdelta steps moved deltas, far smaller than the full checkpoint
    assert out["methods"]["ckptdelta"]["bytes"] < out["methods"]["full_reload_dir"]["bytes"]
    assert out["methods"]["full_reload_dir"]["bytes"] >= out["meta"]["model_bytes"]
    tk = out["tokens"]
    assert tk["errors"] == 0 and tk["requests"] > 0 and len(tk["hotloads"]) >= 2
    assert all(h["verified"] for h in tk["hotloads"])
    assert tk["idle_tokens_per_s"] > 0 and tk["prepare_window_s"] > 0
    assert {t["target"].split(" (")[0] for t in out["targets"]} >= {
        "pause on vLLM <= 1/3 of vLLM's full reload from a directory",
        "publish() -> serving the new version <= 1/5 of the full-checkpoint path",
        "tokens/s while a hot-load prepares >= 70% of idle"}
    assert "ckptdelta" in capsys.readouterr().out
