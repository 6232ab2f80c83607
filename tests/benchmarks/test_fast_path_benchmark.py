"""benchmarks/fast_path.py: each setting encodes the same step, decodes back exactly, and the tries are put back
as they are after the *as before* settings."""

from __future__ import annotations

import torch

from benchmarks import fast_path
from ckptdelta.delta import codec
from ckptdelta.delta.encodings import frames


def test_every_setting_encodes_the_step_and_the_tries_are_put_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(40_000, generator=g), "b": torch.randn(300, 64, generator=g).to(torch.bfloat16)}
    new = {"a": old["a"] + torch.randn(40_000, generator=g) * 1e-4, "b": old["b"].clone()}
    new["b"][::7] = (old["b"][::7].float() * 1.01).to(torch.bfloat16)
    now, dense_stage = frames.may_beat, codec._stage_dense
    r = fast_path.measure(old, new, repeats=1)
    assert frames.may_beat is now and codec._stage_dense is dense_stage
    assert all(r[s[0]]["stage_s"] > 0 and r[s[0]]["stage_chunkwise_s"] > 0 for s in fast_path.SETTINGS)
    assert {"xor+zstd3", *(s[0] for s in fast_path.SETTINGS)} <= set(r)
    assert all(r[k]["bytes"] > 0 and r[k]["encode_s"] > 0 for k in r if isinstance(r[k], dict))
    out = {"command": "python -m benchmarks.fast_path", "repeats": 1, "rows": [("step", r)]}
    assert "| step |" in fast_path.markdown(out)
    fast_path.plot(out, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 5_000
