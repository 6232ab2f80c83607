"""``ckptdelta hotload URL... SNAPSHOT`` and ``ckptdelta status URL...`` against real replicas, some of them failing.

Every replica is the real app under uvicorn on 127.0.0.1 over runs the real
Publisher wrote; the failures are real ones: a replica of another run, a delta
object corrupted at rest, a port nobody listens on.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from ckptdelta.cli import main
from delta.errors import PolicyVersionTimeoutError
from loader.client import RolloutClient
from tests.replicas import PROMPT, corrupt_delta, lm_dir, publish_run, run, start_replica  # noqa: F401


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _rows(out: str) -> dict[str, list[str]]:
    """The table's rows by replica URL (columns split on runs of two or more spaces)."""
    import re

    return {cols[0]: cols for cols in (re.split(r"\s{2,}", ln.strip()) for ln in out.splitlines())
            if cols and cols[0].startswith("http://")}


def test_fleet_hotload_one_replica_of_another_run_is_refused_the_other_loads(start_replica, run, lm_dir, tmp_path,
                                                                            capsys):
    other = publish_run(str(tmp_path / "other" / "run"), lm_dir, n_versions=2)
    try:
        ours, theirs = start_replica(1, replica_id="ours"), start_replica(1, bucket=other.url, replica_id="theirs")
        listed = tmp_path / "replicas.txt"
        listed.write_text(f"# the fleet\n{theirs.url}/\n\n")
        assert main(["hotload", ours.url, "--replicas-file", str(listed), "latest", "--wait"]) == 1
        cap = capsys.readouterr()
        rows = _rows(cap.out)
        assert cap.out.startswith(f"hot-load of v{run.latest:08d} (latest) on 2 replicas: 1 READY, 1 REJECTED")
        assert rows[ours.url][1:3] == ["READY", f"v{run.latest:08d}"] and rows[ours.url][3].endswith("s")
        assert rows[theirs.url][1:3] == ["REJECTED", "v00000001"] and "serves run" in rows[theirs.url][-1]
        assert "1 of 2 replicas not READY" in cap.err and theirs.url in cap.err
        assert ours.status()["policy_version"] == run.latest and theirs.status()["policy_version"] == 1

        dead = _dead_url()
        assert main(["status", ours.url, theirs.url, dead]) == 1
        cap = capsys.readouterr()
        rows = _rows(cap.out)
        assert rows[ours.url][1:3] == ["READY", f"v{run.latest:08d}"] and rows[theirs.url][2] == "v00000001"
        assert rows[dead][1] == "UNREACHABLE" and "did not answer" in cap.err
        assert main(["status", ours.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[ours.url]["policy_version"] == run.latest
    finally:
        other.close()


def test_fleet_hotload_a_corrupt_delta_fails_one_replica_and_not_the_other(start_replica, lm_dir, tmp_path, capsys):
    bad = publish_run(str(tmp_path / "bucket" / "run"), lm_dir, n_versions=3)
    try:
        behind, there = start_replica(1, bucket=bad.url, replica_id="behind"), start_replica(2, bucket=bad.url)
        corrupt_delta(bad, 2)                  # only the replica still at v1 has to read it
        assert main(["hotload", behind.url, there.url, "2", "--wait", "--json"]) == 1
        states = json.loads(capsys.readouterr().out)
        assert states[behind.url]["state"] == "FAILED" and "checksum" in states[behind.url]["reason"].lower()
        assert states[there.url]["state"] == "READY" and states[there.url]["noop"] is True
        assert behind.status()["policy_version"] == 1     # still serving what it had
        assert main(["hotload", behind.url, there.url, "1", "--wait"]) == 0    # a rollback for one, a no-op for one
        rows = _rows(capsys.readouterr().out)
        assert [rows[u][1:3] for u in (behind.url, there.url)] == [["READY", "v00000001"]] * 2
    finally:
        bad.close()


def test_the_newest_hotload_request_wins_on_a_busy_replica(start_replica, run):
    rep = start_replica(1)
    with rep.engine.step():                    # a forward step that does not end: the swap to v2 waits for it
        first = rep.post("/v1/hotload", {"snapshot": 2}).json()
        rep.wait(first["id"], states=("SWAPPING",))
        assert rep.post("/v1/hotload", {"snapshot": 3}).status_code == 409     # without queue: refused
        older = rep.post("/v1/hotload", {"snapshot": 3, "queue": True})
        assert older.status_code == 202 and older.json()["state"] == "QUEUED"
        newer = rep.post("/v1/hotload", {"snapshot": 0, "queue": True}).json()
        assert newer["state"] == "QUEUED" and rep.status()["queued_hotload"]["id"] == newer["id"]
        dropped = rep.http.get(f"/v1/hotload/{older.json()['id']}").json()
        assert dropped["state"] == "FAILED" and dropped["error_type"] == "HotLoadSuperseded"
        assert newer["id"] in dropped["reason"]
        assert rep.post("/v1/hotload", {"snapshot": 0, "queue": True}).json()["id"] == newer["id"]   # joins it
    assert rep.wait(first["id"])["state"] == "READY"
    done = rep.wait(newer["id"])
    assert done["state"] == "READY" and done["from_version"] == 2 and done["timings"]["prepare_s"] > 0
    assert rep.status()["policy_version"] == 0 and rep.status()["queued_hotload"] is None


def test_a_policy_version_timeout_is_raised_after_the_whole_ready_timeout(start_replica):
    rep = start_replica(1)
    with RolloutClient([rep.url], ready_timeout=1.5, backoff_base=0.4, backoff_max=5.0) as client:
        t0 = time.monotonic()
        with pytest.raises(PolicyVersionTimeoutError, match="within the ready_timeout of 1.5s") as info:
            client.sample(PROMPT, max_tokens=1, min_policy_version=99)
        assert time.monotonic() - t0 >= 1.5, "raised before the timeout it names"
    assert "tries in " in str(info.value)


def test_an_unknown_flag_points_to_the_subcommands_help(capsys):
    assert main(["status", "http://127.0.0.1:1", "--frobnicate"]) == 2
    assert "ckptdelta status: error: unrecognized arguments: --frobnicate (see ckptdelta status --help)" in \
        capsys.readouterr().err
    assert main(["hotload", "http://127.0.0.1:1", "http://127.0.0.1:2"]) == 2
    assert "the last argument is the snapshot" in capsys.readouterr().err
