"""The codec benchmark's quick mode runs end to end: every codec on every quick workload, bit-exact,
with its table, JSON and plot written. No timing is asserted: timings belong to the benchmark."""

from __future__ import annotations

import json

from benchmarks import codec


def test_quick_codec_benchmark_writes_a_bit_exact_table_json_and_plot(tmp_path, capsys):
    assert codec.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| ckptdelta |" in out and "| xor+zstd3 |" in out and "| sparse-idx+zstd3 |" in out
    data = json.loads((tmp_path / "codec-quick.json").read_text())
    rows = data["rows"]
    assert rows and all(r["exact"] in (True, None) for r in rows)
    names = {r["workload"] for r in rows}
    assert {"bf16-lr1e-06-1step", "bf16-lr1e-05-1step", "bf16-lr1e-06-10step"} <= names
    for w in names:
        mine = next(r for r in rows if r["workload"] == w and r["codec"] == "ckptdelta")
        xor = next(r for r in rows if r["workload"] == w and r["codec"] == "xor+zstd3")
        assert mine["ratio"] >= xor["ratio"], w      # never worse than the field's XOR+zstd
    assert (tmp_path / "codec-quick.png").stat().st_size > 10_000
    assert "limit ratio" in (tmp_path / "codec-quick.md").read_text()
