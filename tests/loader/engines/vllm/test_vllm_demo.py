"""``make demo`` on its default engine (benchmarks/demo.py): ``ckptdelta serve --engine vllm``, every hot-load
proven by the replica, vLLM's own sampled logprobs against the trainer's. The reference engine's demo and the
demo's estimators: tests/benchmarks/test_demo.py."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.benchmarks.test_demo import _demo


def test_demo_on_vllm_every_hot_load_is_proven_bit_exact_by_the_replica_and_k_is_finite(tmp_path):
    """The default demo: ``ckptdelta serve --engine vllm``; vLLM's own sampled logprobs against the trainer's."""
    report = _demo(tmp_path, "vllm", engine="vllm")
    rows, s = report["rows"], report["summary"]
    assert report["config"]["engine"] == "vllm" and len(rows) == 3
    expected = 0
    for r in rows:
        assert r["served_versions"] == [expected] and r["served_ok"]
        expected = r["published_version"]
        # the replica's own in-pause check (engine.last_swap of /v1/status), not the trainer's belief
        assert r["replica_verified"] is True
        if r["trained_tokens"]:
            assert r["verified_tensors"] > 0 and r["pause_ms"] > 0 and r["bytes_fetched"] > 0
        assert all(math.isfinite(r[k]) for k in ("k1", "k2", "k3", "max_abs_diff"))
        assert r["k2"] >= 0 and r["k3"] >= 0 and r["tokens"] >= 6 * 4
    assert any(r["trained_tokens"] for r in rows)
    # vLLM's kernels are not the trainer's: small, and honestly not zero
    assert 0 < s["max_abs_diff"] < 1 and s["k_max"] < 0.05
    assert s["replica_verified_all"] is True and s["all_served_by_previous_version"]
    final = s["final_live_check"]  # every live tensor, read back by vLLM's worker, = the trainer's bf16 policy
    assert final["differ"] == [] and final["tensors"] == 21 and final["workers"] == 1
    assert set(s["k_drift"]) == {"k1", "k2", "k3"}
    assert (tmp_path / "vllm" / "demo.png").stat().st_size > 0
    with pytest.raises(httpx.TransportError):  # the replica (and the vLLM behind it) was stopped
        httpx.get(report["replica_url"] + "/v1/status", timeout=2)
