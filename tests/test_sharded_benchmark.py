"""Smoke test of benchmarks/sharded.py (slow: three 1- and 2-rank gloo jobs): a tiny run writes its table, JSON and
plot, every delta of the DTensor publish gathered no tensor bytes, the gather baseline gathered the other rank's
share, and a replica hot-loaded every timed delta. No timing is asserted."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_a_tiny_sharded_run_counts_no_tensor_bytes_for_deltas_and_writes_markdown_json_and_png(tmp_path):
    from benchmarks import sharded

    assert sharded.main(["--gb", "0.02", "--steps", "1", "--quick", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "sharded.md").read_text()
    assert "| DTensor publish (each rank its shards) | 2 |" in md and "gather, then rank 0 publishes" in md
    assert "metadata only: met" in md and "## Rank 0's metadata per publish at scale" in md
    assert (tmp_path / "sharded.png").stat().st_size > 10_000
    out = json.loads((tmp_path / "sharded.json").read_text())
    by = {(r["method"], r["ranks"]): r for r in out["results"]}
    two = by[("dtensor", 2)]
    assert all(p["gathered_tensor_bytes"] == 0 and p["gathered_object_bytes"] > 0 for p in two["per_rank"])
    assert sum(p["written_bytes"] for p in two["per_rank"]) > 0 and all(p["written_bytes"] for p in two["per_rank"])
    assert two["per_rank"][0]["anchor_tensor_bytes"] > 0 and two["replica"]["prepare_s"] > 0
    base = by[("gather", 2)]
    assert base["per_rank"][1]["gathered_tensor_bytes"] == two["per_rank"][0]["own_bytes"]
