"""benchmarks/codec_auto runs end to end on the tiny workload: every variant publishes every delta through
both shaped links, its replica hot-loads each one, and the table, JSON and plot are written. No timing or choice is asserted: those belong
to the benchmark's table."""

from __future__ import annotations

import json

from benchmarks import codec_auto


def test_the_codec_auto_benchmark_writes_its_table_json_and_plot(tmp_path, capsys):
    assert codec_auto.main(["--size", "tiny", "--steps", "3", "--rates", "10,1000", "--lrs", "1e-6",
                            "--out-dir", str(tmp_path), "--name", "smoke"]) == 0
    assert "| 10 Mbit/s | **auto** |" in capsys.readouterr().out
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert [(c["lr"], c["rate_bit"]) for c in data["cases"]] == [(1e-6, 10e6), (1e-6, 1e9)]
    for link in data["cases"]:
        for v in codec_auto.VARIANTS:
            rows = [r for r in link["rows"] if r["variant"] == v]
            assert [r["step"] for r in rows] == [1, 2, 3]
            assert all(r["codec"] in ("context", "fast") and r["stored_bytes"] > 0 for r in rows)
            assert all(r["swapped_s"] == r["total_s"] + r["hotload_s"] and r["hotload_s"] > 0 for r in rows)
            if v != "auto":
                assert {r["codec"] for r in rows} == {v}
        assert all(r["reason"].startswith("auto: ") for r in link["rows"] if r["variant"] == "auto")
    assert "| workload | link | codec | codecs used |" in (tmp_path / "smoke.md").read_text()
    assert (tmp_path / "smoke.png").stat().st_size > 10_000
