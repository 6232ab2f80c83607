"""Two ranks on gloo publish one snapshot together: each writes its own tensors, rank 0 commits."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptdelta.delta.errors import PublishInputError
from ckptdelta.publisher import Publisher
from ckptdelta.publisher.runs import read_manifest
from tests.publisher_helpers import assert_same, open_store, perturb, snapshot, versions, weights

WORLD = 2


def _rank_main(rank: int, init_file: str, url: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = []
        w = weights()
        mine = {n for i, n in enumerate(w) if i % WORLD == rank}
        with Publisher(url, shard_bytes=3000, anchor_every=3, partition=mine) as pub:
            for step in range(4):            # anchor, delta, delta, anchor
                r = pub.publish(w, step)     # the full dict; partition picks this rank's tensors
                results.append([r.version, r.kind, r.stored_bytes, r.n_changed_tensors])
                perturb(w, seed=step)
            try:  # one rank's bad input fails the publish on every rank, and nothing is committed
                bad = dict(w)
                if rank == 1:
                    bad[min(mine)] = torch.empty(2, device="meta")
                pub.publish(bad, 4)
                results.append("published")
            except PublishInputError as e:
                results.append(f"refused: {e}")
        # A restarted job whose ranks pass only their own shard: the parents come from the bucket.
        with Publisher(url) as pub:
            r = pub.publish({n: w[n] for n in mine}, 4, wait=False).result(120)
            results.append([r.version, r.kind, r.stored_bytes, r.n_changed_tensors])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_commit_the_union_of_their_tensors_bit_exactly(tmp_path):
    url = str(tmp_path / "run")
    mp.spawn(_rank_main, args=(str(tmp_path / "init"), url, str(tmp_path)), nprocs=WORLD, join=True)
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    # Every rank got the same answer for every publish (rank-local timings aside).
    assert res[0][:4] == res[1][:4]
    assert [r[1] for r in res[0][:4]] == ["anchor", "delta", "delta", "anchor"]
    assert res[0][4].startswith("refused") and res[1][4].startswith("refused") and "meta" in res[1][4]
    assert res[0][5][:2] == [4, "delta"] and res[0][5] == res[1][5]

    store = open_store((url, {}))
    assert versions(store) == [0, 1, 2, 3, 4]
    for v in range(5):
        assert_same(snapshot(store, v), _expected(v))
    # Anchors: shards from both ranks numbered as one set, with one index over all tensors.
    m0 = read_manifest(store, 0, None)
    names = [o.key.rsplit("/", 1)[1] for o in m0.objects]
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > WORLD and shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                              for i in range(len(shards))]
    index = json.loads(store.get(next(o.key for o in m0.objects if o.key.endswith("index.json"))))
    assert sorted(index["weight_map"]) == sorted(weights())
    # Deltas: one object per rank.
    m1 = read_manifest(store, 1, None)
    assert sorted(o.key.rsplit("/", 1)[1] for o in m1.objects) == ["rank-00000.ckd", "rank-00001.ckd"]


def _expected(version: int) -> dict:
    """The weights at ``version``: publish i happened after perturbations 0..i-1."""
    w = weights()
    for s in range(version):
        perturb(w, seed=s)
    return w
