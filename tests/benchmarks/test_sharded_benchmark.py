"""benchmarks/sharded.py. The smoke test (slow: two rounds of three 1- and 2-rank gloo jobs): a tiny run writes its
table, JSON and plot, every delta of the DTensor publish gathered no tensor bytes, the gather baseline gathered the
other rank's share, and a replica hot-loaded every timed delta; no timing is asserted. The fast ones: the rounds
interleave the configurations and pool their steps (jobs replaced by synthetic ones, so the figures are known),
and a result from before rounds renders as one round."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from benchmarks import sharded

BASE = {("dtensor", 1): 1.0, ("dtensor", 2): 0.5, ("gather", 2): 2.0}


def _fake_jobs(monkeypatch) -> list[tuple[str, int]]:
    """Replace the gloo jobs: each step of the n-th job (counting every configuration) takes its configuration's
    base time x (1 + 0.1 n), a machine that slows down as the run goes on; the first round's warm anchor shows
    an extra RSS of 99 bytes, every other publish 7. Returns the calls in order."""
    calls: list[tuple[str, int]] = []

    def job(method, world, gb, n_steps, codec, *, first):
        t = BASE[(method, world)] * (1 + 0.1 * len(calls))
        calls.append((method, world))
        n_rows = sharded.WARM + n_steps + 1 + first
        row = {"trainer_s": t, "cpu_s": t, "gather_s": 0.0, "copy_s": 0.0, "encode_s": t, "upload_s": 0.0,
               "commit_s": 0.0, "stored_bytes": 10, "gathered_tensor_bytes": 0, "gathered_object_bytes": 5,
               "rss_extra": 7, "largest_gather": 3}
        ranks = [{"rows": [dict(row) for _ in range(n_rows)], "written": {str(i): [4] * world for i in range(n_rows)},
                  "own_bytes": 100 // world, "full_bytes": 100, "largest_tensor": 40} for _ in range(world)]
        if first:
            for rk in ranks:
                rk["rows"][-1]["rss_extra"] = 99
        return {"ranks": ranks, "replica": {"prepare_s": 0.1, "pause_s": 0.01} if first else {}, "anchor": first}

    monkeypatch.setattr(sharded, "job", job)
    return calls


def test_rounds_run_every_configuration_in_turn_reversing_the_order_and_pool_their_steps(monkeypatch):
    calls = _fake_jobs(monkeypatch)
    configs = list(BASE)
    res, order = sharded.run(configs, 0.01, 2, "fast", 3, log=lambda m: None)
    assert calls == configs + configs[::-1] + configs
    assert order == [["dtensor-1", "dtensor-2", "gather-2"], ["gather-2", "dtensor-2", "dtensor-1"],
                     ["dtensor-1", "dtensor-2", "gather-2"]]
    one, two, base = res
    assert [r["trainer_s"] for r in one["rounds"]] == pytest.approx([1.0, 1.5, 1.6])     # jobs 0, 5, 6
    assert [r["trainer_s"] for r in two["rounds"]] == pytest.approx([0.55, 0.7, 0.85])   # jobs 1, 4, 7
    assert one["trainer_s"] == pytest.approx(1.5) and two["trainer_s"] == pytest.approx(0.7)  # pooled medians
    assert len(one["samples"][0]) == 6 and len(two["samples"]) == 2
    assert sharded.round_ratios(one, two) == pytest.approx([0.55, 0.7 / 1.5, 0.85 / 1.6])
    assert two["per_rank"][1]["written_bytes"] == 4 and two["replica"]["prepare_s"] == 0.1
    assert [p["anchor_rss_extra"] for p in two["per_rank"]] == [99, 99]          # the first round's anchor
    assert base["rounds"][1]["trainer_s"] == pytest.approx(2.0 * 1.3)                     # job 3


def test_the_report_gives_each_rounds_order_and_ratio_and_their_spread(monkeypatch):
    _fake_jobs(monkeypatch)
    res, order = sharded.run(list(BASE), 0.01, 2, "fast", 3, log=lambda m: None)
    md = sharded.report(res, [], Namespace(codec="fast", steps=2), 1.0, order)
    assert "3 rounds, each a fresh job of every configuration" in md
    assert "| 2 | gather, 2 ranks, 1 rank | 1.500 (1.50, 1.50) | 0.700 (0.70, 0.70) | 0.47x | 2.600 |" in md
    assert "spans **0.47-0.55x** over 3 rounds (0.55x, 0.47x, 0.53x); pooled, 0.47x" in md
    assert "target <= 0.6x: met, in 3 of 3 rounds" in md


def test_a_result_from_before_rounds_renders_as_one_round(monkeypatch):
    _fake_jobs(monkeypatch)
    res, _ = sharded.run(list(BASE), 0.01, 3, "fast", 1, log=lambda m: None)
    for r in res:
        del r["rounds"]                 # what a run before rounds wrote
    md = sharded.report(res, [], Namespace(codec="fast", steps=3), 1.0)
    assert "medians of 3 deltas after 2 untimed" in md
    assert "| 1 | 1 rank, 2 ranks, gather | 1.000 (1.00, 1.00, 1.00) | 0.550 (0.55, 0.55, 0.55) | 0.55x |" in md
    assert "One round: each configuration ran once" in md and "pooled over" not in md


@pytest.mark.slow
def test_a_tiny_sharded_run_counts_no_tensor_bytes_for_deltas_and_writes_markdown_json_and_png(tmp_path):
    assert sharded.main(["--gb", "0.02", "--steps", "1", "--quick", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "sharded.md").read_text()
    assert "| DTensor publish (each rank its shards) | 2 |" in md and "gather, then rank 0 publishes" in md
    assert "metadata only: met" in md and "## Rank 0's metadata per publish at scale" in md
    assert "| 2 | gather, 2 ranks, 1 rank |" in md and "over 2 rounds" in md        # --quick: 2 rounds
    assert (tmp_path / "sharded.png").stat().st_size > 10_000
    out = json.loads((tmp_path / "sharded.json").read_text())
    assert out["order"][1] == ["gather-2", "dtensor-2", "dtensor-1"]
    by = {(r["method"], r["ranks"]): r for r in out["results"]}
    assert all(len(r["rounds"]) == 2 and len(r["samples"][0]) == 2 for r in out["results"])
    two = by[("dtensor", 2)]
    assert all(p["gathered_tensor_bytes"] == 0 and p["gathered_object_bytes"] > 0 for p in two["per_rank"])
    assert sum(p["written_bytes"] for p in two["per_rank"]) > 0 and all(p["written_bytes"] for p in two["per_rank"])
    assert two["per_rank"][0]["anchor_tensor_bytes"] > 0 and two["replica"]["prepare_s"] > 0
    base = by[("gather", 2)]
    assert base["per_rank"][1]["gathered_tensor_bytes"] == two["per_rank"][0]["own_bytes"]
