"""``ckptdelta hotload URL... SNAPSHOT`` and ``ckptdelta status URL...`` against real replicas, some of them failing.

Every replica is the real app under uvicorn on 127.0.0.1 over runs the real
Publisher wrote; the failures are real ones: a replica of another run, a delta
object corrupted at rest, a port nobody listens on, a replica still starting (its
port bound, refusing connections), and real HTTP servers that hang or answer
garbage (tests/bad_replicas.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from ckptdelta.cli import main
from ckptdelta.delta.errors import PolicyVersionTimeoutError
from ckptdelta.loader.client import RolloutClient
from tests.bad_replicas import (ERROR_500, HANG, HTML, JSON_LIST, OTHER_SCHEMA, BadReplica, dead_url,
                                replica_status)
from tests.replicas import PROMPT, corrupt_delta, lm_dir, publish_run, run, start_replica, state_bits_equal  # noqa: F401


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

        dead = dead_url()
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
    # the replaced one is counted as such, not as a failure an operator's alert would fire on
    counts = {line.split('"')[1]: float(line.split()[-1]) for line in rep.http.get("/metrics").text.splitlines()
              if line.startswith("ckptdelta_hotloads_total{")}
    assert counts == {"ready": 2.0, "superseded": 1.0}, counts


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


def test_fleet_hotload_loads_the_live_replica_at_once_while_another_still_starts_then_that_one_once_up(
        start_replica, run, capsys):
    """Regression (issue 39, defect 4): ``--wait`` first waited for every replica to answer, so one that did not
    (dead, or still starting) held every hot-load back for the whole --timeout, and the live replicas were then
    reported failed ("not READY within the timeout"). Each replica goes on its own now: the live one, listed
    after the starting one, is READY while the other still refuses connections; that one is hot-loaded once up."""
    starting = start_replica(1, replica_id="starting", listen=False)    # as serve's port, before its checks end
    live = start_replica(1, replica_id="live")
    out: dict = {}
    cli = threading.Thread(target=lambda: out.setdefault("rc", main(
        ["hotload", starting.url, live.url, "latest", "--wait", "--timeout", "60", "--json"])))
    cli.start()
    try:
        while live.status()["policy_version"] != run.latest:
            assert cli.is_alive(), "the command ended without hot-loading the live replica"
            time.sleep(0.02)
        with pytest.raises(httpx.ConnectError):
            httpx.get(starting.url + "/v1/status")      # the other still refuses: nothing waited for it
    finally:
        starting.listen()
        cli.join(120)
    assert out["rc"] == 0
    states = json.loads(capsys.readouterr().out)
    assert [(states[r.url]["state"], states[r.url]["target_version"]) for r in (starting, live)] == \
        [("READY", run.latest)] * 2
    for r in (starting, live):
        assert state_bits_equal(r.engine.model, run.truth[run.latest]) == []


def _bad_members(run_id: str, latest: int) -> dict[str, BadReplica]:
    """A hung server, garbage where /v1/status is, and two of the right run whose hot-load answers are garbage."""
    status = (200, "application/json", replica_status(run_id))
    accepted = (202, "application/json", {"id": "hl-0001-impostor", "state": "PREPARING", "target_version": latest})
    return {
        "hung": BadReplica({("GET", "/"): HANG}),
        "html": BadReplica({("GET", "/v1/status"): HTML}),
        "list": BadReplica({("GET", "/v1/status"): JSON_LIST}),
        "schema": BadReplica({("GET", "/v1/status"): OTHER_SCHEMA}),
        "500": BadReplica({("GET", "/v1/status"): ERROR_500}),
        "post": BadReplica({("GET", "/v1/status"): status, ("POST", "/v1/hotload"): HTML}),
        "poll": BadReplica({("GET", "/v1/status"): status, ("POST", "/v1/hotload"): accepted,
                            ("GET", "/v1/hotload/"): OTHER_SCHEMA}),
    }


def test_fleet_hotload_and_status_give_each_dead_hung_slow_or_garbage_member_its_own_row_and_serve_the_others(
        start_replica, run, capsys):
    """Issue 39, the fan-out class: a garbage answer (not JSON, another schema, HTTP 500) ended the command
    with a JSONDecodeError or KeyError and no table. Each member that is not a working replica now gets a row
    saying what it did, the hung one listed first included, and the replica beside them is READY."""
    live = start_replica(run.latest, replica_id="live")       # already there: nothing to wait for
    slow = start_replica(1, replica_id="slow")                # its swap waits for a forward step that does not end
    dead = dead_url()
    with contextlib.ExitStack() as stack:
        bad = {k: stack.enter_context(b) for k, b in _bad_members(live.status()["run_id"], run.latest).items()}
        fleet = [bad["hung"].url, dead, *(bad[k].url for k in ("html", "list", "schema", "500", "post", "poll")),
                 slow.url, live.url]
        with slow.engine.step():
            assert main(["hotload", *fleet, "latest", "--wait", "--timeout", "2", "--json"]) == 1
        cap = capsys.readouterr()
        states = json.loads(cap.out)
        assert states[live.url]["state"] == "READY" and states[live.url]["target_version"] == run.latest
        assert states[slow.url]["state"] in ("PREPARING", "SWAPPING")
        assert states[slow.url]["error"] == f"not READY within the timeout of 2s (still {states[slow.url]['state']})"
        assert slow.wait(states[slow.url]["id"])["state"] == "READY"     # it goes on once the step ends
        rows = {k: (states[b.url]["state"], states[b.url]["error"]) for k, b in bad.items()}
        rows["dead"] = (states[dead]["state"], states[dead]["error"])
        assert rows["hung"][0] == "UNREACHABLE" and "did not answer in time" in rows["hung"][1]
        assert rows["dead"][0] == "UNREACHABLE" and "still refused after 2s" in rows["dead"][1]
        for k in ("html", "list", "schema", "post"):
            assert rows[k][0] == "REJECTED" and "not a ckptdelta replica's answer" in rows[k][1], rows[k]
        assert rows["500"][0] == "REJECTED" and "with 500" in rows["500"][1]
        assert rows["poll"][0] == "PREPARING" and "GET /v1/hotload/hl-0001-impostor" in rows["poll"][1]
        assert "9 of 10 replicas not READY" in cap.err

        assert main(["hotload", dead, live.url, "latest"]) == 1           # without --wait: refused is final
        assert "still refused" not in capsys.readouterr().out

        assert main(["status", *fleet, "--timeout", "2"]) == 1
        cap = capsys.readouterr()
        table = _rows(cap.out)
        assert table[live.url][1:3] == ["READY", f"v{run.latest:08d}"]
        assert [table[u][1] for u in fleet[:2]] == ["UNREACHABLE"] * 2
        assert [table[bad[k].url][1] for k in ("html", "list", "schema", "500")] == ["REJECTED"] * 4
        assert "not a ckptdelta replica's answer" in table[bad["schema"].url][-1]
        assert [table[bad[k].url][1] for k in ("post", "poll")] == ["READY"] * 2     # their status is well-formed
        assert "6 of 10 replicas did not answer" in cap.err
