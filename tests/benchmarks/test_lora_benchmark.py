"""Smoke test of benchmarks/lora.py (slow: one vLLM start on a tiny base, a trainer and a replica process, through a
shaped bucket where network namespaces work): a quick run writes its table, JSON and plot, every method's steps
carry the same adapter bits into vLLM (the baselines' LoRA buffers equal ckptdelta's serving slot, bit for bit),
every method's write was timed inside the vLLM worker, every ckptdelta request ran on one version, and no request
failed. No timing is asserted."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_a_quick_lora_run_loads_the_same_adapter_bits_by_every_method_and_writes_markdown_json_and_png(tmp_path):
    from benchmarks import lora

    assert lora.main(["--quick", "--out-dir", str(tmp_path)]) == 0          # 0: every step checked exact
    out = json.loads((tmp_path / "lora-quick.json").read_text())
    assert {(r["lr"], r["method"]) for r in out["rows"]} == {(lr, m) for lr in (1e-5, 1e-4)
                                                              for m in ("ckptdelta", "full", "xor")}
    assert all(r["exact"] and r["bytes"] > 0 and r["publish_to_serving_s"] > 0 for r in out["rows"])
    # the pause of every method timed the same way: inside the vLLM worker, for each step's write
    assert all(0 < r["hold_s"] for r in out["rows"])
    for s in out["samples"]:
        key = "load_s" if s["method"] != "ckptdelta" else "write_s"
        assert s["workers"] and all(w[key] > 0 for w in s["workers"]), s
    checks = out["ranks"][0]["checks"]
    assert len(checks) == 2 and all(v is True for c in checks for v in c.values()) and all(len(c) == 2 for c in checks)
    load = out["ranks"][0]["load"]
    assert load["ckptdelta"]["requests"] > 0 and load["ckptdelta"]["mixed_versions"] == 0
    assert all(v["failed"] == 0 for v in load.values())
    # the (b) full adapter is the whole adapter: its bytes per step are the adapter's, at least
    full = [r for r in out["rows"] if r["method"] == "full"]
    assert all(r["bytes"] >= out["ranks"][0]["adapter_bytes"] for r in full)
    md = (tmp_path / "lora-quick.md").read_text()
    assert "## Targets" in md and "| (a) ckptdelta" in md and "engine loop held (worker)" in md and ("1 Gbit/s" in md or "UNSHAPED" in md)
    # every timed step's trainer side, each method's, beside the stage table's means
    assert "The trainer side of each timed step" in md and "- rank 16, lr 1e-05: (a) " in md and "; (c) " in md
    # the CPU each process spent in each step, by role: vLLM generated for the sampling load throughout
    assert all({"trainer", "replica", "vLLM"} <= set(s["cpu"]) and s["cpu"]["vLLM"] > 0 for s in out["samples"])
    assert "The CPU each process spent in a step" in md and "**trainer + replica + S3 server**" in md
    assert (tmp_path / "lora-quick.png").stat().st_size > 10_000
