"""PublishCallback in the HF Trainer's usual multi-process set-up: two processes under torchrun, DDP on gloo on the
CPU, the real Trainer on the tiny LM, a local-directory bucket (tests/integrations/ddp_trainer.py is each rank).
Every rank's callback is called at the same events with the same model; these tests prove that each set-up a user
would write either publishes the model every rank holds once per step, bit-exact, with every rank agreeing on
the versions, or is refused at train begin on every rank with advice, before anything is committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ckptdelta.loader import SnapshotReader
from ckptdelta.publisher.runs import committed_versions, read_manifest
from tests.publisher_helpers import open_store
from tests.replicas import lm_dir  # noqa: F401

WORLD = 2
WORKER = os.path.join(os.path.dirname(__file__), "ddp_trainer.py")


def _torchrun(case: str, lm_dir: str, tmp_path) -> tuple[str, list[dict]]:
    """Run the two ranks of ``case`` to their end; the bucket's URL and each rank's report."""
    url, out = str(tmp_path / "run"), tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={WORLD}", WORKER, case, lm_dir, url, str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return url, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _assert_published_bits(url: str, version: int, trained_path: str) -> None:
    """The snapshot at ``version`` is what rank 0 trained, bit for bit (tied aliases are published once)."""
    trained = load_file(trained_path)
    published = SnapshotReader(url).read_tensors(version)
    assert published and set(published) <= set(trained)
    for name, t in published.items():
        assert torch.equal(t.view(torch.uint8), trained[name].view(torch.uint8)), name
    SnapshotReader(url).verify(version)


@pytest.mark.parametrize("case", ["replicated", "partition"])
def test_ddp_ranks_publish_the_model_they_all_hold_once_per_step_and_agree_on_every_version(lm_dir, tmp_path,
                                                                                            case):
    """DDP: every rank holds the whole model and calls publish(model). The Publisher refuses a tensor two ranks
    hand it, so the callback has rank 0 publish it while the others join each publish's rounds with nothing, or,
    for a Publisher built with a partition, every rank its share: one manifest per step either way, on every
    rank the same versions, and the snapshots are the trained weights bit for bit."""
    url, ranks = _torchrun(case, lm_dir, tmp_path)
    assert [r["error"] for r in ranks] == [None, None]
    assert ranks[0]["results"] == ranks[1]["results"]
    assert ranks[0]["results"] == [[0, 0, "anchor"], [1, 1, "delta"], [2, 2, "delta"]]
    assert [r["seen"] for r in ranks] == [[1, 2], [1, 2]]
    store = open_store((url, {}))
    assert committed_versions(store) == [0, 1, 2]
    _assert_published_bits(url, 2, str(tmp_path / "out" / "trained.safetensors"))
    delta = read_manifest(store, 2, None)
    writers = sorted(o.key.rsplit("/", 1)[1] for o in delta.objects)
    # rank 0 encodes everything, or each rank its partition's share
    assert writers == (["rank-00000.ckd"] if case == "replicated" else ["rank-00000.ckd", "rank-00001.ckd"])
    assert "config.json" in {os.path.basename(o.key) for o in read_manifest(store, 0, None).extra_files}


def test_a_lora_adapter_on_two_ranks_is_published_by_rank_0_and_every_rank_learns_each_version(lm_dir, tmp_path):
    """A LoRA adapter is published by one process: Publisher(url, distributed=False) on rank 0 and
    PublishCallback(None) on the other rank. Rank 0 publishes the adapter as a LoRA run, and published_version()
    (what FleetRollout pins every rank's sampling to) gives the other rank each version rank 0 committed."""
    url, ranks = _torchrun("lora", lm_dir, tmp_path)
    assert [r["error"] for r in ranks] == [None, None]
    assert [(v, s) for v, s, _k in ranks[0]["results"]] == [(0, 0), (1, 1), (2, 2)]
    assert ranks[1]["results"] == []                   # rank 1 published nothing itself
    assert [r["seen"] for r in ranks] == [[1, 2], [1, 2]]
    store = open_store((url, {}))
    assert committed_versions(store) == [0, 1, 2]
    assert read_manifest(store, 2, None).adapter is not None
    _assert_published_bits(url, 2, str(tmp_path / "out" / "trained.safetensors"))


def test_a_lora_adapter_with_a_publisher_on_every_rank_is_refused_at_train_begin_saying_what_to_build(lm_dir,
                                                                                                      tmp_path):
    """A distributed Publisher cannot publish an adapter (it refuses one at world size > 1) and the callback
    cannot publish through it from one rank: every rank refuses at train begin, before anything is committed,
    naming the set-up that works."""
    url, ranks = _torchrun("lora-distributed", lm_dir, tmp_path)
    for r in ranks:
        kind, message = r["error"]
        assert kind == "PublishInputError"
        assert "Publisher(url, distributed=False)" in message and "PublishCallback(None)" in message
        assert r["results"] == [] and r["seen"] == []
    assert committed_versions(open_store((url, {}))) == []
