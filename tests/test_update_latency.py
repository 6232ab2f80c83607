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
    # the hot-load wrote exactly the elements the step changed; the delta is far smaller than the model
    assert d["elements_changed"] == d["elements_changed_expected"] > 0
    assert sparse["elements_changed"] == sparse["elements_changed_expected"] > 0
    assert sparse["elements_changed"] < d["elements_changed"]
    assert d["kind"] == sparse["kind"] == "delta" and 0 < d["stored_bytes"] < r["model_bytes"] / 10
    assert r["full"]["stored_bytes"] >= r["model_bytes"]
    for k in update_latency.DELTA_PARTS:
        assert d[k] >= 0
    assert "ckptdelta" in capsys.readouterr().out
