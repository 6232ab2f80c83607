"""A rank's own failure during a sharded publish reaches every rank as a PublishError at once, never a wait.

One real job serves every test here (a module fixture: the ranks' imports are paid once): 2 gloo ranks
publish DTensors (``Shard(0)``, so an anchor sends each tensor's pieces to the rank writing its shard) and a
plain tensor each. Each rank in turn then fails locally, by real faults of its own: a file-size limit
(``RLIMIT_FSIZE``: EFBIG) that refuses its plain anchor shard, one that lets its plain shard through but
refuses the shard of pieces it writes during the exchange, a temp dir that cannot be created, its storage
refusing the upload of its shard of pieces (an OSError raised in the Store's ``put_file``), and a delta's
write, temp dir and upload; after each rank's turn the job publishes an anchor or a delta that must commit. Without
status rounds the first of these left the other rank waiting for a piece until the group's timeout (torch's
30 minutes): the job's bound (``JOIN_S``, well under the publishers' ``collective_timeout``) is the proof.
Last, rank 1 stops taking part without dying: rank 0 fails after its publisher's ``collective_timeout``.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import resource
import signal
import tempfile
import time
import traceback

import pytest
import torch

from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from ckptdelta.publisher.runs import committed_versions
from ckptdelta.delta.storage import Store
from tests.publisher_helpers import assert_same, perturb, run_ranks

pytestmark = pytest.mark.timeout(600)

WORLD = 2
SHARD_BYTES = 3000
JOIN_S = 300              # the whole job; each failing publish alone would hang for collective_timeout
LONG_TIMEOUT_S = 900      # the publishers' collective_timeout while ranks fail locally: never reached
SHORT_TIMEOUT_S = 3       # the publisher whose rank 1 stops publishing
PIECED = ("piece.a", "piece.b", "piece.c")   # 5120, 7680 and 3200 bytes: one shard each, rank 0 writes a and c
#: lets a rank's plain anchor shard (1.7 kB) through, refuses a shard of pieces (3.3 to 7.9 kB)
PIECES_ONLY_LIMIT = 2600

#: (name, anchor, fault): each failing publish, run with rank 0 failing, then rank 1
FAULTS = [("anchor-efbig-plain-shard", True, "fsize0"),
          ("anchor-efbig-piece-shard", True, "fsize-pieces"),
          ("anchor-no-temp-dir", True, "no-tempdir"),
          ("anchor-upload-of-piece-shard-refused", True, "upload-pieces"),
          ("delta-efbig", False, "fsize0"),
          ("delta-no-temp-dir", False, "no-tempdir"),
          ("delta-upload-refused", False, "upload")]
REFUSED = "the bucket refused the upload (injected)"
CASES = [(name, rank) for rank in range(WORLD) for name, _a, _f in FAULTS]


def _truth(step: int) -> dict[str, torch.Tensor]:
    """Every tensor whole at ``step``: base weights after the perturbations of steps 0..step-1."""
    g = torch.Generator().manual_seed(7)
    w = {"piece.a": torch.randn(64, 40, generator=g).to(torch.bfloat16),
         "piece.b": torch.randn(48, 40, generator=g),
         "piece.c": torch.randn(40, 40, generator=g).to(torch.bfloat16),
         "plain.r0": torch.randn(20, 20, generator=g),
         "plain.r1": torch.randn(20, 20, generator=g)}
    for s in range(step):
        perturb(w, seed=s, frac=0.05)
    return w


#: step -> the version committed for it: anchor, delta, then an anchor after rank 0's failures, a delta after
#: rank 1's
COMMITTED = {0: 0, 1: 1, 2 + len(FAULTS): 2, 3 + 2 * len(FAULTS): 3}


def _rank_main(rank: int, init_file: str, url: str, url_timeout: str, out_dir: str, stopped: object) -> None:
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a write past RLIMIT_FSIZE fails with EFBIG instead
    tmp = os.path.join(out_dir, f"tmp-rank{rank}")
    os.makedirs(tmp)
    tempfile.tempdir = tmp
    mesh = init_device_mesh("cpu", (WORLD,))

    def state(step: int) -> dict:
        full = _truth(step)
        sd = {n: DTensor.from_local(full[n].chunk(WORLD)[rank].clone(), mesh, [Shard(0)], run_check=False)
              for n in PIECED}
        sd[f"plain.r{rank}"] = full[f"plain.r{rank}"]
        return sd

    def publish(pub: Publisher, step: int, anchor: bool, fault: str | None) -> dict:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        put_file = pub.store.put_file

        def refuse(key: str, path: str) -> None:     # this rank's storage refuses its upload (of a shard of pieces)
            if fault == "upload" or os.path.getsize(path) > PIECES_ONLY_LIMIT:
                raise OSError(errno.EIO, REFUSED)
            put_file(key, path)
        t0 = time.monotonic()
        try:
            if fault == "fsize0":
                resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
            elif fault == "fsize-pieces":
                resource.setrlimit(resource.RLIMIT_FSIZE, (PIECES_ONLY_LIMIT, limit[1]))
            elif fault == "no-tempdir":
                tempfile.tempdir = os.path.join(tmp, "gone")
            elif fault in ("upload", "upload-pieces"):
                pub.store.put_file = refuse
            r = pub.publish(state(step), step, anchor=anchor)
            out = {"version": r.version, "kind": r.kind}
        except Exception as e:  # noqa: BLE001 - what each rank got is the result
            out = {"error": type(e).__name__, "message": str(e)}
            if e.__cause__ is not None:     # the failing rank's own error: where it was raised
                out["where"] = [f.name for f in traceback.extract_tb(e.__cause__.__traceback__)]
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            tempfile.tempdir = tmp
            pub.store.put_file = put_file
        out["seconds"] = round(time.monotonic() - t0, 2)   # for people reading the results; never asserted
        return out

    results: dict = {}
    with Publisher(url, shard_bytes=SHARD_BYTES, anchor_every=100, codec="fast", progress=False,
                   collective_timeout=LONG_TIMEOUT_S) as pub:
        results["0"] = publish(pub, 0, False, None)
        results["1"] = publish(pub, 1, False, None)
        step = 2
        for failing in range(WORLD):
            for name, anchor, fault in FAULTS:
                results[f"{name}@{failing}"] = publish(pub, step, anchor, fault if rank == failing else None)
                step += 1
            results[str(step)] = publish(pub, step, failing == 0, None)   # an anchor after rank 0's, then a delta
            step += 1
        results["left_in_tmp"] = sorted(n for n in os.listdir(tmp) if n.startswith("ckptdelta-"))
    # Rank 1 stops taking part (alive, its publisher open) while rank 0 publishes.
    with Publisher(url_timeout, codec="fast", progress=False, collective_timeout=SHORT_TIMEOUT_S) as pub:
        if rank == 0:
            results["stopped"] = publish(pub, 0, False, None)
            stopped.set()
        else:
            stopped.wait()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        os._exit(0)     # without the publisher's close or the group's teardown: rank 0's group timed out


@pytest.fixture(scope="module")
def faulty_job(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    url, url_timeout = str(d / "run"), str(d / "run-timeout")
    stopped = multiprocessing.get_context("spawn").Event()
    assert run_ranks(_rank_main, WORLD, lambda r: (str(d / "init"), url, url_timeout, str(d), stopped), JOIN_S) == \
        [0, 0]
    return url, [json.load(open(d / f"rank{r}.json")) for r in range(WORLD)]


@pytest.mark.parametrize("name,failing", CASES, ids=[f"{n}-rank{r}" for n, r in CASES])
def test_a_local_failure_of_one_rank_fails_the_publish_on_every_rank_with_a_publish_error_naming_it(
        faulty_job, name, failing):
    _url, results = faulty_job
    cause = "File too large" if "efbig" in name else REFUSED if "upload" in name else "No such file or directory"
    for rank in range(WORLD):
        got = results[rank][f"{name}@{failing}"]
        assert got.get("error") == "PublishError", f"rank {rank}: {got}"
        assert got["message"].startswith(f"rank {failing}: ") and cause in got["message"], f"rank {rank}: {got}"
        assert "nothing is committed" in got["message"] and "of run" in got["message"]
    # each fault hit where it was meant to: before the piece exchange, in the middle of it, or after it
    where = results[failing][f"{name}@{failing}"]["where"]
    expected = {"anchor-efbig-plain-shard": "write_anchor", "anchor-efbig-piece-shard": "_one_shard",
                "anchor-no-temp-dir": "write_anchor", "anchor-upload-of-piece-shard-refused": "refuse"}
    assert expected.get(name, "write_delta_object") in where, where


def test_nothing_of_a_failed_publish_is_committed_and_the_next_anchor_and_delta_commit_bit_exact(faulty_job):
    url, results = faulty_job
    for rank in range(WORLD):
        assert [(results[rank][str(s)].get("version"), results[rank][str(s)].get("kind")) for s in COMMITTED] == \
            list(zip(COMMITTED.values(), ["anchor", "delta", "anchor", "delta"])), results[rank]
    assert committed_versions(Store.from_url(url)) == sorted(COMMITTED.values())
    reader = SnapshotReader(url)
    for step, version in COMMITTED.items():
        assert_same(reader.read_tensors(version), _truth(step))
    assert reader.verify().chain == [2, 3]
    assert results[0]["left_in_tmp"] == results[1]["left_in_tmp"] == []    # the failed publishes' temp dirs too


def test_a_rank_that_stops_publishing_fails_the_other_after_the_publishers_collective_timeout(faulty_job):
    _url, results = faulty_job
    got = results[0]["stopped"]
    assert got.get("error") == "CollectiveError" and "the publishers'" in got["message"], got
    assert "stopped" not in results[1]
