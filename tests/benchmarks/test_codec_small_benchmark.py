"""The small-tensors codec benchmark builds Qwen2.5-0.5B's tensors as the model has them, and its run is
bit-exact with its table, JSON and plot written. No timing is asserted: timings belong to the benchmark."""

from __future__ import annotations

import json

import pytest

from benchmarks import codec_small


def test_the_workload_has_qwen2_5_0_5b_s_290_tensors_and_494m_parameters():
    shapes = codec_small.shapes("qwen2.5-0.5b")
    assert len(shapes) == 290                        # tied embeddings: no lm_head
    n = 0
    for s in shapes.values():
        k = 1
        for d in s:
            k *= d
        n += k
    assert n == 494_032_768                          # the model card's parameter count
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (128, 896)
    assert shapes["model.layers.23.mlp.down_proj.weight"] == (896, 4864)


@pytest.mark.slow   # ~5-12 s (numba's kernels loaded, a plot drawn): make stress; the suite is near its CI limit
def test_a_run_of_the_small_tensors_is_bit_exact_and_writes_its_table_json_and_plot(tmp_path, capsys):
    assert codec_small.main(["--layers", "2", "--no-embed", "--max-elems", "1000", "--repeats", "1",
                             "--out", str(tmp_path)]) == 0
    assert "| ckptdelta |" in capsys.readouterr().out
    data = json.loads((tmp_path / "codec_small-upto1000.json").read_text())
    assert data["tensors"] == 2 * 5 + 1               # per layer 2 norms and 3 biases, and the final norm
    assert all(r["exact"] for r in data["rows"])
    assert {r["codec"] for r in data["rows"]} == {"xor+zstd3", "ckptdelta", "ckptdelta fast (no ctx)"}
    assert (tmp_path / "codec_small-upto1000.png").stat().st_size > 5_000
