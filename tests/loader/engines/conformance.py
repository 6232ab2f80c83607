"""The engine contract (loader/engines/base.py) as one suite that every replica engine runs: complete, stream,
hot-load forward, back and across an anchor, a failed apply rolled back, status, stop.

:class:`EngineContract` defines the cases; each engine's tests subclass it (as zarr's StoreTests is subclassed
per store) and provide the replica they run on:

- fixture ``replica``: a started :class:`tests.replicas.Replica` on a version of ``published``, READY. Every
  case of a subclass shares it, in the order written here, so it starts once (module-scoped where the engine
  is costly to start: a vLLM start is 40-80 s on two cores); the last case stops it, so a module that shares
  its replica with other tests defines its subclass after them;
- fixture ``published``: the run it serves, with ``truth[v]``, version v's weights;
- ``kind``: the engine's name (``/v1/status``'s ``engine.kind``);
- ``hotload_path(published)``: hot-load targets in order, going forward, across an anchor and back; and the
  run's anchor versions (a hot-load goes through an anchor when it goes back, or past one);
- ``live_diff(replica, published, version, tmp_path)``: the names whose live bits (read back from the engine)
  differ from version's;
- ``fail_next_apply(replica, monkeypatch)``: make the next hot-load fail inside the pause, after it wrote
  (part of) the new bits into the engine; ``failed_apply_target`` may pick the version it is tried on;
- ``assert_released(replica)``: what the engine held (processes, shared memory) is gone after a stop;
- ``generations(replica)``: (generations running now, generations that ran to their end), as the engine itself
  counts them;
- ``long_generation``: a ``max_tokens`` whose generation lasts well past a poll of :meth:`generations`.
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.replicas import PROMPT, Replica


class EngineContract:
    kind: str = "?"
    long_generation: int = 200

    # --- what a subclass provides -------------------------------------------------------------------------

    def hotload_path(self, published) -> tuple[list[int], set[int]]:
        """The versions to hot-load in order (forward, across an anchor, back) and which of them are anchors:
        each engine's run has its own chain. Every subclass says it."""
        raise NotImplementedError

    def live_diff(self, replica: Replica, published, version: int, tmp_path) -> list[str]:
        """The names of live weights whose bits differ from ``version``'s, read back the engine's own way."""
        raise NotImplementedError

    def fail_next_apply(self, replica: Replica, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make the replica's next apply fail where that engine can fail (a real fault, not a stub)."""
        raise NotImplementedError

    def failed_apply_target(self, replica: Replica, published) -> int:
        """The version whose hot-load :meth:`fail_next_apply` fails: by default the newest the replica does not
        serve."""
        return max(v for v in published.truth if v != replica.engine.version)

    # --- the contract ---------------------------------------------------------------------------------------

    def test_a_completion_answers_tokens_logprobs_and_the_version_it_ran_on(self, replica):
        v = replica.status()["policy_version"]
        body = replica.complete(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True, return_token_ids=True,
                                return_engine_data=True)
        (choice,) = body["choices"]
        assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length" and choice["text"]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == 4 and all(x <= 0 for x in lp["token_logprobs"])
        ed = body["engine_data"]
        assert ed["policy_version"] == v and ed["policy_versions"] == [v] and ed["crossed_swap"] is False
        assert ed["snapshot"] == f"v{v:08d}"
        again = replica.complete(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True, return_token_ids=True)
        assert again["choices"][0]["token_ids"] == choice["token_ids"]          # greedy: the same tokens
        assert "engine_data" not in again
        seeded = [replica.complete(max_tokens=5, temperature=1.0, n=2, seed=7, return_token_ids=True)["choices"]
                  for _ in range(2)]
        assert len(seeded[0]) == 2 and [c["text"] for c in seeded[0]] == [c["text"] for c in seeded[1]]
        chat = replica.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                     "max_tokens": 3, "return_engine_data": True})
        assert chat.status_code == 200, chat.text
        assert chat.json()["object"] == "chat.completion" and chat.json()["engine_data"]["policy_versions"] == [v]
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"

    def test_a_stream_joins_to_the_plain_answer_and_ends_with_engine_data_then_done(self, replica):
        v = replica.status()["policy_version"]
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        plain = replica.post("/v1/completions", body)
        assert plain.status_code == 200, plain.text
        with replica.http.stream("POST", "/v1/completions",
                                 json={**body, "stream": True, "return_engine_data": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"] == [] and last["engine_data"]["policy_versions"] == [v]
        chunks = [json.loads(e) for e in events[:-2]]
        assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == plain.json()["choices"][0]["text"]
        assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")] == ["length"]
        assert {ch["model"] for ch in chunks} == {replica.engine.model_name}      # the run's name
        self.after_stream(replica)

    def test_status_is_ready_and_names_the_version_snapshot_and_engine(self, replica):
        st = replica.status()
        v = replica.engine.version
        assert st["state"] == "READY" and st["policy_version"] == v and st["snapshot"] == f"v{v:08d}", st
        assert st["engine"]["kind"] == self.kind
        assert replica.http.get("/health").status_code == 200
        r = replica.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "min_policy_version": v + 1000})
        assert r.status_code == 408 and r.json()["error"]["type"] == "policy_version_too_old"

    def test_hotloads_forward_across_an_anchor_and_back_leave_every_live_weight_bit_exact(self, replica, published,
                                                                                          tmp_path):
        path, anchors = self.hotload_path(published)
        current = replica.engine.version
        assert any(t < current for t in path) or any(b < a for a, b in zip(path, path[1:])), "no hot-load back"
        for target in path:
            job = replica.hotload(target)
            assert job["state"] == "READY", job
            if target == current:               # the version it serves: nothing to load, nothing reported
                assert replica.engine.version == target and self.live_diff(replica, published, target, tmp_path) == []
                continue
            back_or_past_an_anchor = target < current or any(current < a <= target for a in anchors)
            assert job["report"]["from_version"] == current and job["report"]["to_version"] == target
            assert job["report"]["via_anchor"] is back_or_past_an_anchor, (current, target, job["report"])
            assert replica.engine.version == target and replica.status()["policy_version"] == target
            assert self.live_diff(replica, published, target, tmp_path) == [], target
            ed = replica.complete(max_tokens=1, return_engine_data=True)["engine_data"]
            assert ed["policy_versions"] == [target]
            current = target

    def test_a_failed_apply_rolls_back_and_the_previous_version_serves_on_bit_exact(self, replica, published,
                                                                                    monkeypatch, tmp_path):
        before = replica.engine.version
        answer = replica.complete(max_tokens=6, temperature=0, ignore_eos=True)["choices"][0]["text"]
        target = self.failed_apply_target(replica, published)
        self.fail_next_apply(replica, monkeypatch)
        job = replica.hotload(target)
        assert job["state"] == "FAILED" and job["reason"], job
        st = replica.status()
        assert replica.engine.version == before and st["policy_version"] == before and st["state"] == "READY", st
        assert self.live_diff(replica, published, before, tmp_path) == []
        again = replica.complete(max_tokens=6, temperature=0, ignore_eos=True, return_engine_data=True)
        assert again["choices"][0]["text"] == answer and again["engine_data"]["policy_versions"] == [before]
        monkeypatch.undo()
        job = replica.hotload(target)                       # nothing left over: the same hot-load goes through
        assert job["state"] == "READY", job
        assert self.live_diff(replica, published, target, tmp_path) == []

    def test_a_plain_request_whose_client_leaves_mid_generation_is_stopped_and_counted_499(self, replica):
        """A plain answer is sent only when the generation ends: a client that stopped waiting (its timeout, a
        killed process) must not leave the engine generating for nobody, beside that client's next try.

        The client leaves only once it saw the engine generate and before any answer came. On a loaded machine
        one poll of :meth:`generations` can outlast a whole generation; such a try proves nothing either way,
        so it is made again (the engine ran it to its end before the client could leave). Three tries were once
        not enough on a loaded 2-core CI host (vLLM's 200 tokens, all a 256-token context leaves room for)."""
        tries = 6
        for _ in range(tries):
            if self._leave_mid_generation(replica):
                assert replica.complete(max_tokens=2)["choices"]      # and the replica serves on
                return
        pytest.fail(f"in {tries} tries every generation of {self.long_generation} tokens ended before a poll "
                    f"of the engine saw it run: the machine is too loaded for this case")

    def _leave_mid_generation(self, replica: Replica) -> bool:
        """One try: False when the generation ended before the client could leave it mid-way."""
        running, finished = self.generations(replica)
        assert running == 0
        left = _requests_with_status(replica, 499)
        body = json.dumps({"prompt": PROMPT, "max_tokens": self.long_generation, "n": 4, "ignore_eos": True,
                           "seed": 1}).encode()
        auth = replica.http.headers.get("authorization")
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: replica\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n" + (f"Authorization: {auth}\r\n" if auth else "") + "\r\n")
        url = urlsplit(replica.url)
        seen = []
        with socket.create_connection((url.hostname, url.port), timeout=30) as s:
            s.sendall(head.encode() + body)
            _wait_for(lambda: seen.append(self.generations(replica)) or seen[-1] != (0, finished),
                      "the generation to start")
            if seen[-1][0] == 0 or select.select([s], [], [], 0)[0]:
                # it ran to its end unseen, or its answer is already here: the client cannot leave mid-way; it
                # takes the whole answer, so that the replica counts it before the next try reads its counts
                assert _read_answer(s).startswith(b"HTTP/1.1 200 ")
                _wait_for(lambda: self.generations(replica)[0] == 0, "the unseen generation to end")
                return False
        # the connection is closed while the engine generates: the client left
        _wait_for(lambda: self.generations(replica)[0] == 0, "the generation to end")
        _wait_for(lambda: _requests_with_status(replica, 499) == left + 1, "the request to be counted 499")
        assert self.generations(replica) == (0, finished), "the engine generated the whole answer for nobody"
        return True

    def test_a_stopped_replica_refuses_connections_and_its_engine_is_released(self, replica):
        assert replica.complete(max_tokens=1)["choices"]
        replica.close()
        with pytest.raises(httpx.TransportError):
            httpx.get(replica.url + "/v1/status", timeout=5)
        replica.engine.close()                              # idempotent: a second stop is a no-op
        self.assert_released(replica)

    def generations(self, replica: Replica) -> tuple[int, int]:
        """(generations running now, generations that ran to their end)."""
        raise NotImplementedError

    def after_stream(self, replica: Replica) -> None:
        """What else a finished stream leaves as it should (a subclass's engine-specific checks)."""

    def assert_released(self, replica: Replica) -> None:
        """What the engine held is gone after a stop (a subclass adds its engine's processes, shared memory)."""


def _requests_with_status(replica: Replica, status: int) -> float:
    line = f'ckptdelta_requests_total{{endpoint="/v1/completions",status="{status}"}}'
    text = replica.http.get("/metrics").text
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def _read_answer(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 answer with a Content-Length, from a socket that asked for it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, "the replica closed the connection without an answer"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(h.split(b":", 1)[1]) for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:"))
    while len(rest) < length:
        chunk = s.recv(65536)
        assert chunk, "the replica closed the connection mid-answer"
        rest += chunk
    return head


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
