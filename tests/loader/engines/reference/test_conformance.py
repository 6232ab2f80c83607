"""The reference engine (ckptdelta's own decode loop over a transformers model) runs the engine contract
(tests/loader/engines/conformance.py) on the tiny LM: one replica for every case, started on v0 of a run
with a second anchor (v3)."""

from __future__ import annotations

import pytest

from ckptdelta.loader import stopping
from tests.lm import rl_step
from tests.loader.engines.conformance import EngineContract
from tests.replicas import Replica, lm_dir, publish_run, state_bits_equal  # noqa: F401 (lm_dir: a fixture)


@pytest.fixture(scope="module")
def published(tmp_path_factory, lm_dir):  # noqa: F811
    """v0 anchor, v1-v2 deltas, v3 anchor, v4 delta."""
    run = publish_run(str(tmp_path_factory.mktemp("bucket") / "run"), lm_dir, n_versions=3)
    new = rl_step(run.truth[2], seed=3)
    run.truth[run.publisher.publish(new, 3, anchor=True).version] = {k: t.clone() for k, t in new.items()}
    run.publish_next()
    yield run
    run.close()


@pytest.fixture(scope="module")
def replica(published):
    from ckptdelta.loader.engines import build_engine

    rep = Replica(build_engine("reference", bucket=published.url, snapshot=0), replica_id="reference-0")
    yield rep
    rep.close()


class TestReferenceEngine(EngineContract):
    kind = "reference"

    def hotload_path(self, published):
        return [1, 2, 4, 1], {0, 3}

    long_generation = 480

    def generations(self, replica):
        st = replica.status()["engine"]
        return st["generating"], st["finished"]

    def live_diff(self, replica, published, version, tmp_path):
        return state_bits_equal(replica.engine.engine.model, published.truth[version])

    def fail_next_apply(self, replica, monkeypatch):
        """Every tensor written, then the pause fails before it ends (where a stop could hold it)."""
        real = stopping.hold

        def fail_at_the_proof(phase: str) -> None:
            if phase == "proof":
                monkeypatch.setattr(stopping, "hold", real)
                raise RuntimeError("failed in the pause after every tensor was written (test)")
            real(phase)

        monkeypatch.setattr(stopping, "hold", fail_at_the_proof)
