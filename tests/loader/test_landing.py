"""A hot-load asked for the version being published: it waits for the commit and fetches the delta's objects as
they land (loader/landing.py), each used only once the manifest names it with the same size and xxh3. Real HTTP
(the replica server on uvicorn), the real Publisher, the S3 API (moto on 127.0.0.1) and a local directory."""

from __future__ import annotations

import os
import threading
import time

import pytest
from safetensors.torch import load_file

import ckptdelta.publisher.publisher as publisher_mod
from ckptdelta.delta.storage import Store
from ckptdelta.loader.engines.reference.model import load_engine
from ckptdelta.publisher import Publisher
from tests.lm import hf_extra_files, rl_step
from tests.replicas import Replica, lm_dir, state_bits_equal  # noqa: F401


@pytest.fixture(params=["local", "s3"])
def bucket(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run"), {}
    return request.getfixturevalue("s3_root")


class HeldCommit:
    """Holds the publisher's commit (the manifest's create) until :meth:`release`, so that a test can look at the
    replica while the delta's objects are stored and the version is not yet committed."""

    def __init__(self, monkeypatch):
        self.reached, self.go = threading.Event(), threading.Event()
        real = publisher_mod.commit

        def held(store, manifest, data=None):
            self.reached.set()
            assert self.go.wait(60), "the test never released the commit"
            return real(store, manifest, data)

        monkeypatch.setattr(publisher_mod, "commit", held)

    def release(self) -> None:
        self.go.set()


def started(bucket, lm_dir, n_versions: int = 2):
    url, opts = bucket
    weights = load_file(os.path.join(lm_dir, "model.safetensors"))
    pub = Publisher(url, storage_options=opts, extra_files=hf_extra_files(lm_dir))
    truth = {pub.publish(weights, 0).version: weights}
    for v in range(1, n_versions):
        truth[v] = rl_step(truth[v - 1], seed=1000 + v)
        pub.publish(truth[v], v)
    engine, reader = load_engine(bucket=url, snapshot="latest", storage_options=opts)
    return pub, truth, Replica(engine, reader=reader)


def test_a_hotload_asked_before_the_publish_waits_for_the_commit_and_takes_the_objects_that_landed_meanwhile(
        bucket, lm_dir, monkeypatch):
    pub, truth, rep = started(bucket, lm_dir)
    try:
        r = rep.post("/v1/hotload", {"snapshot": 2, "await_commit_s": 60})
        assert r.status_code == 202 and r.json()["state"] == "PREPARING" and r.json()["await_commit_s"] == 60, r.text
        job_id = r.json()["id"]
        held = HeldCommit(monkeypatch)
        truth[2] = rl_step(truth[1], seed=1002)
        publishing = threading.Thread(target=lambda: pub.publish(truth[2], 2))
        publishing.start()
        assert held.reached.wait(60)
        # the delta is stored, its manifest not: the replica has it already, and still serves v1
        deadline = time.monotonic() + 30
        while (landing := rep.reader._landing) is None or landing.held_bytes == 0:
            assert time.monotonic() < deadline, "the replica fetched nothing before the commit"
            time.sleep(0.01)
        assert rep.status()["policy_version"] == 1
        held.release()
        publishing.join(60)
        job = rep.wait(job_id)
        assert job["state"] == "READY", job
        # every record came from what landed: nothing of the delta was fetched after the commit
        assert job["bytes_landed"] > 0 and job["report"]["bytes_fetched"] == 0, job
        assert job["timings"]["commit_wait_s"] > 0, job
        assert state_bits_equal(rep.engine.model, truth[2]) == []
        assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_version"] == 2
        assert rep.reader._landing is None            # dropped with its hot-load
    finally:
        rep.close()
        pub.close()


def test_bytes_that_landed_and_differ_from_the_manifest_or_objects_it_never_names_are_not_used(
        bucket, lm_dir, monkeypatch):
    """A landed object whose bytes are not the manifest's (damaged after they were fetched, here) is dropped and
    fetched again; an object of another writer under the version's prefix (a racing or failed attempt) is never
    named by the manifest and never used. The hot-load is exact either way."""
    pub, truth, rep = started(bucket, lm_dir)
    store = Store.from_url(*bucket)
    try:
        stray = "deltas/000000000002-0000dead-1/rank-00000.ckd"
        store.put(stray, b"not a delta object of this run" * 100)
        r = rep.post("/v1/hotload", {"snapshot": 2, "await_commit_s": 60})
        assert r.status_code == 202, r.text
        held = HeldCommit(monkeypatch)
        truth[2] = rl_step(truth[1], seed=1002)
        publishing = threading.Thread(target=lambda: pub.publish(truth[2], 2))
        publishing.start()
        assert held.reached.wait(60)
        ours = [k for k in store.list_prefix("deltas/000000000002-") if k != stray]
        deadline = time.monotonic() + 30
        while (landing := rep.reader._landing) is None or not set(ours) <= set(landing._objects):
            assert time.monotonic() < deadline, "the replica did not fetch the parts before the commit"
            time.sleep(0.01)
        assert stray in landing._objects
        damaged = bytearray(landing._objects[ours[0]])
        damaged[len(damaged) // 2] ^= 0x01
        landing._objects[ours[0]] = bytes(damaged)
        held.release()
        publishing.join(60)
        job = rep.wait(r.json()["id"])
        assert job["state"] == "READY", job
        assert job["report"]["bytes_fetched"] > 0, job             # the damaged object, read again
        assert (job["bytes_landed"] > 0) == (len(ours) > 1), job    # the others, as they landed
        assert state_bits_equal(rep.engine.model, truth[2]) == []
    finally:
        rep.close()
        pub.close()


def test_awaiting_a_version_that_never_comes_fails_the_hotload_after_its_wait_and_serves_on(tmp_path, lm_dir):
    pub, truth, rep = started((str(tmp_path / "run"), {}), lm_dir)
    try:
        t0 = time.monotonic()
        job = rep.wait(rep.post("/v1/hotload", {"snapshot": 5, "await_commit_s": 0.3}).json()["id"])
        assert job["state"] == "FAILED" and job["error_type"] == "HotLoadTimeoutError", job
        assert "version 5" in job["reason"] and "0.3 s" in job["reason"] and time.monotonic() - t0 < 10
        assert rep.status()["policy_version"] == 1 and state_bits_equal(rep.engine.model, truth[1]) == []
        # without a wait, an uncommitted version is 404 as before; a committed one needs none
        assert rep.post("/v1/hotload", {"snapshot": 5}).status_code == 404
        assert rep.hotload(0)["state"] == "READY"
        # an old version that is not committed never will be; "latest" cannot be awaited; the wait is bounded
        r = rep.post("/v1/hotload", {"snapshot": "v00000001", "await_commit_s": 5})
        assert r.status_code in (200, 202) and rep.wait(r.json()["id"])["state"] == "READY"
        for body, status, needle in [({"snapshot": 2, "await_commit_s": 0}, 400, "await_commit_s"),
                                     ({"snapshot": 2, "await_commit_s": 1e9}, 400, "await_commit_s"),
                                     ({"snapshot": 2, "await_commit_s": "soon"}, 400, "await_commit_s")]:
            r = rep.post("/v1/hotload", body)
            assert r.status_code == status and needle in r.text, (body, r.text)
    finally:
        rep.close()
        pub.close()


def test_a_replica_stopping_ends_a_hotload_that_awaits_a_commit_at_once(tmp_path, lm_dir):
    pub, truth, rep = started((str(tmp_path / "run"), {}), lm_dir)
    try:
        job = rep.post("/v1/hotload", {"snapshot": 2, "await_commit_s": 600}).json()
        manager = rep.server.server.config.app.state.hotloads
        t0 = time.monotonic()
        ended = manager.stop("the replica is stopping (test)", timeout=30)
        assert ended is not None and ended.state == "FAILED" and ended.error_type == "HotLoadCancelledError", ended
        assert "stopping" in ended.reason and time.monotonic() - t0 < 5 and ended.id == job["id"]
    finally:
        rep.close()
        pub.close()


def test_one_versions_objects_are_listed_without_the_others_on_every_backend(store_url):
    url, opts = store_url
    store = Store.from_url(url, opts)
    keys = ["deltas/000000000005-aa-1/rank-00000.ckd", "deltas/000000000005-aa-1/rank-00000-001.ckd",
            "deltas/000000000050-bb-2/rank-00000.ckd", "deltas/000000000006-aa-2/rank-00000.ckd",
            "manifests/000000000005.json"]
    for k in keys:
        store.put(k, b"x")
    assert store.list_prefix("deltas/000000000005-") == sorted(keys[:2])
    assert store.list_prefix("deltas/00000000000") == sorted([keys[0], keys[1], keys[3]])
    assert store.list_prefix("deltas/") == sorted(keys[:4])


def test_the_cli_and_both_clients_ask_every_replica_for_the_version_being_published(tmp_path, lm_dir, capsys):
    """``ckptdelta hotload URL... N --await-commit S --wait``, ``RolloutClient.hotload(N, await_commit_s=S)`` and
    the async client's, each asked before N is published: every replica waits for the commit and serves N."""
    import asyncio

    from ckptdelta.cli import main
    from ckptdelta.loader.async_client import AsyncRolloutClient
    from ckptdelta.loader.client import RolloutClient

    pub, truth, rep = started((str(tmp_path / "run"), {}), lm_dir)
    engine, reader = load_engine(bucket=str(tmp_path / "run"), snapshot=1)
    other = Replica(engine, reader=reader, replica_id="r1")
    try:
        for v, ask in ((2, lambda: main(["hotload", rep.url, other.url, "2", "--await-commit", "60", "--wait"])),
                       (3, lambda: RolloutClient([rep.url, other.url]).hotload(3, await_commit_s=60)),
                       (4, lambda: asyncio.run(AsyncRolloutClient([rep.url, other.url]).hotload(
                           4, await_commit_s=60)))):
            answers: list = []
            asking = threading.Thread(target=lambda: answers.append(ask()))
            asking.start()
            deadline = time.monotonic() + 30
            while not all(r.status().get("hotload") for r in (rep, other)):     # both asked, both waiting
                assert time.monotonic() < deadline and asking.is_alive(), answers
                time.sleep(0.01)
            truth[v] = rl_step(truth[v - 1], seed=1000 + v)
            assert pub.publish(truth[v], v).version == v
            asking.join(60)
            assert answers and answers[0] not in (1, None), answers
            for r in (rep, other):
                assert r.status()["policy_version"] == v and state_bits_equal(r.engine.model, truth[v]) == []
        assert "2 READY" in capsys.readouterr().out
    finally:
        other.close()
        rep.close()
        pub.close()


def test_what_is_held_before_a_commit_is_bounded_and_an_object_past_the_bound_is_left_for_after_it(tmp_path):
    """Each object is read once, by one ranged read of at most the room left plus one byte: one that fills it is
    too large, is dropped and is never read again before the commit; the total held never passes ``max_bytes``."""
    from ckptdelta.loader.landing import Landing

    store = Store.from_url(str(tmp_path / "run"), {})
    for i, n in enumerate((300, 500, 200)):
        store.put(f"deltas/000000000007-aa-1/rank-00000{'' if i == 0 else f'-{i:03d}'}.ckd", bytes([i]) * n)
    landing = Landing(store, 7, max_bytes=600, max_object_bytes=400)
    assert landing.poll() == 2 and landing.held_bytes == 500 and landing.requests == 4   # a listing, three reads
    assert landing.poll() == 0 and landing.requests == 5                            # the big one is not read again
    assert sorted(len(v) for v in landing._objects.values()) == [200, 300]
