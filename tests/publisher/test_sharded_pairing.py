"""A sharded publisher's ranks stay paired call for call, whatever one rank's call raises, and a commit that
lands is never reported as lost.

One real job (3 gloo ranks, each publishing a tensor of its own): every rank's publish() of the same call must
meet in the same rounds, or a snapshot would hold one rank's weights of one call beside another rank's of the
next, and pass ``verify``. Before, a call of one rank that raised before reaching the rounds (a
KeyboardInterrupt during its host copy; an earlier background failure that only this rank had not yet been
told of) left that rank one call behind the others for good: each later publish failed on "ranks disagree on
the step", or, with a step published again (allowed), committed such mixes. And when a rank died after sending
its part of the commit round, rank 0 committed, then every rank left said "this publish commits nothing".
"""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
import torch

from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from ckptdelta.publisher.runs import committed_versions
from ckptdelta.delta.storage import Store
from tests.publisher_helpers import assert_same, perturb, run_ranks

pytestmark = pytest.mark.timeout(300)

WORLD = 3
JOIN_S = 200
COLLECTIVE_TIMEOUT_S = 60     # never reached: every failure here is a rank's own, or a rank gone
REFUSED = "this rank's disk refused the delta (injected)"


def _truth(call: int) -> dict[str, torch.Tensor]:
    """Every rank's tensor as its ``call``-th publish() publishes it: each call's weights differ from the last."""
    g = torch.Generator().manual_seed(5)
    w = {f"r{r}.w": torch.randn(24, 24, generator=g) for r in range(WORLD)}
    for c in range(call):
        perturb(w, seed=100 + c, frac=0.1)
    return w


def _die_after_the_commit_rounds_gather(pub: Publisher, delay: float) -> None:
    """This rank exits ``delay`` seconds after the next publish's commit round has gathered its part (the
    second gather of a delta: the plan round's, then the commit round's), before the outcome comes back."""
    gather, seen = pub._comm.gather, []

    def gather_then_die(obj):
        out = gather(obj)
        seen.append(obj)
        if len(seen) == 2:
            time.sleep(delay)
            os._exit(0)
        return out
    pub._comm.gather = gather_then_die


def _rank_main(rank: int, init_file: str, url: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    import ckptdelta.publisher.publisher as pubmod

    results: dict = {}
    calls = [0]

    def record(key: str, fn) -> None:
        try:
            r = fn()
            if hasattr(r, "result"):
                r = r.result()
            results[key] = {"version": r.version, "call": calls[0]}
        except BaseException as e:  # noqa: BLE001 - what each rank got is the result (KeyboardInterrupt too)
            results[key] = {"error": type(e).__name__, "message": str(e), "call": calls[0]}

    def weights() -> dict[str, torch.Tensor]:
        calls[0] += 1
        return {f"r{rank}.w": _truth(calls[0])[f"r{rank}.w"]}

    copy_to_host, write_delta_object = pubmod.copy_to_host, pubmod.write_delta_object

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    def refused(*a, **k):
        raise OSError(errno.EIO, REFUSED)

    pub = Publisher(url, codec="fast", progress=False, collective_timeout=COLLECTIVE_TIMEOUT_S)
    record("first", lambda: pub.publish(weights(), 0))
    record("second", lambda: pub.publish(weights(), 1))
    # rank 1 is interrupted during its host copy; the trainer goes on (and publishes step 2 again)
    if rank == 1:
        pubmod.copy_to_host = interrupted
    record("interrupted", lambda: pub.publish(weights(), 2))
    pubmod.copy_to_host = copy_to_host
    record("after_interrupt", lambda: pub.publish(weights(), 2))
    # a background publish fails on rank 1's disk; only rank 0 asks about it (say, rank-0-only logging code)
    if rank == 1:
        pubmod.write_delta_object = refused
    record("background", lambda: pub.publish(weights(), 3, wait=False))
    pubmod.write_delta_object = write_delta_object
    if rank == 0:
        record("asked", pub.wait_until_finished)
    record("told", lambda: pub.publish(weights(), 3, wait=False))
    record("after_told", lambda: pub.publish(weights(), 3, wait=False))
    # a count out of step (no call of the API leaves one now: the safety net under the rule above)
    if rank == 1:
        pub._calls += 1
    record("out_of_step", lambda: pub.publish(weights(), 3))
    if rank == 1:
        pub._calls -= 1
    # last, rank 2 sends its part of a commit round, then dies before the outcome comes back
    if rank == 2:
        _die_after_the_commit_rounds_gather(pub, 0.3)
    record("died", lambda: pub.publish(weights(), 4))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    os._exit(0)     # the group has a dead rank: no teardown


@pytest.fixture(scope="module")
def paired_job(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairing")
    url = str(d / "run")
    assert run_ranks(_rank_main, WORLD, lambda r: (str(d / "init"), url, str(d)), JOIN_S) == [0] * WORLD
    return url, {r: json.load(open(d / f"rank{r}.json")) for r in (0, 1)}


def _committed_as(url: str, version: int, call: int) -> None:
    """Snapshot ``version`` holds every rank's weights of its ``call``-th publish(), and only those."""
    assert_same(SnapshotReader(url).read_tensors(version), _truth(call))


def test_a_rank_interrupted_in_its_host_copy_fails_that_publish_everywhere_and_the_next_one_pairs_every_rank(
        paired_job):
    url, results = paired_job
    assert results[1]["interrupted"]["error"] == "KeyboardInterrupt"      # the caller gets its own interrupt
    got = results[0]["interrupted"]
    assert got["error"] == "PublishError" and got["message"].startswith("rank 1: ") and "interrupted" in \
        got["message"], got
    assert results[0]["after_interrupt"]["version"] == results[1]["after_interrupt"]["version"] == 2
    _committed_as(url, 2, results[0]["after_interrupt"]["call"])


def test_a_background_failure_told_to_one_rank_only_makes_the_next_publish_skip_on_every_rank_and_the_one_after_commit(
        paired_job):
    url, results = paired_job
    for rank in (0, 1):
        assert results[rank]["background"]["error"] == "PublishError" and REFUSED in \
            results[rank]["background"]["message"], results[rank]
    assert results[0]["asked"]["error"] == "PublishError"       # rank 0 heard of it here; rank 1 at its next call
    told = results[1]["told"]
    assert told.get("error") == "PublishError" and told["message"].startswith("rank 1: ") and REFUSED in \
        told["message"], told
    skipped = results[0]["told"]       # that call publishes nothing anywhere, and is not a new failure to keep
    assert skipped.get("error") == "Skipped" and "an earlier publish" in skipped["message"], skipped
    assert results[0]["after_told"]["version"] == results[1]["after_told"]["version"] == 3
    _committed_as(url, 3, results[0]["after_told"]["call"])


def test_ranks_whose_publish_calls_no_longer_pair_up_fail_the_publish_everywhere_rather_than_commit_a_mix(
        paired_job):
    _url, results = paired_job
    for rank in (0, 1):
        got = results[rank]["out_of_step"]
        assert got.get("error") == "PublishInputError" and "out of step" in got["message"] and \
            "rank 1: call 9" in got["message"], got
    # nothing committed: version 4 holds the next call's weights (the last test)


def test_a_commit_whose_outcome_a_dying_rank_cut_off_is_reported_committed_by_rank_0_and_maybe_by_the_others(
        paired_job):
    url, results = paired_job
    got = results[0]["died"]
    assert got["error"] == "CollectiveError" and "is committed" in got["message"] and "commits nothing" not in \
        got["message"], got
    other = results[1]["died"]          # told the outcome before rank 0's broadcast failed, or not
    assert other.get("version") == 4 or ("may be committed" in other["message"] and "commits nothing" not in
                                         other["message"]), other
    assert committed_versions(Store.from_url(url)) == [0, 1, 2, 3, 4]
    assert SnapshotReader(url).latest() == 4
    _committed_as(url, 4, got["call"])          # the call after the refused one
    assert SnapshotReader(url).verify().chain[-1] == 4


def _refusing_rank_main(rank: int, init_file: str, url: str, out_dir: str) -> None:
    """2 ranks: rank 1's disk refuses its delta, and rank 0 dies once it has every rank's part of the commit round
    (which holds rank 1's error, so it commits nothing)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    import ckptdelta.publisher.publisher as pubmod

    pub = Publisher(url, codec="fast", progress=False, collective_timeout=COLLECTIVE_TIMEOUT_S)
    pub.publish({f"r{rank}.w": _truth(1)[f"r{rank}.w"]}, 0)
    if rank == 1:
        def refused(*a, **k):
            raise OSError(errno.EIO, REFUSED)
        pubmod.write_delta_object = refused
    else:
        _die_after_the_commit_rounds_gather(pub, 0.0)
    try:
        pub.publish({f"r{rank}.w": _truth(2)[f"r{rank}.w"]}, 1)
        got = {"version": "committed"}
    except Exception as e:  # noqa: BLE001 - what the rank got is the result
        got = {"error": type(e).__name__, "message": str(e)}
    with open(os.path.join(out_dir, f"refusing{rank}.json"), "w") as f:
        json.dump(got, f)
    os._exit(0)


def test_a_rank_whose_own_part_of_the_commit_round_failed_reports_its_error_when_rank_0_is_gone_not_a_maybe(
        tmp_path):
    url = str(tmp_path / "run")
    assert run_ranks(_refusing_rank_main, 2, lambda r: (str(tmp_path / "init"), url, str(tmp_path)), JOIN_S) == [0, 0]
    got = json.load(open(tmp_path / "refusing1.json"))
    assert got.get("error") == "PublishError" and REFUSED in got["message"] and "may be committed" not in \
        got["message"], got
    assert committed_versions(Store.from_url(url)) == [0]
