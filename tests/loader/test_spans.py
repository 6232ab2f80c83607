"""A request's span (``engine_data.policy_versions``, loader/spans.py) at every interleaving of its admission and
completion with a replica's swaps: every version served from its admission to its completion, in order.

The reference engine's swaps are driven phase by phase through its own gate (a ServingGate that stops at each
pause's two points: steps held with the old bits in, and the new bits and version in, steps still held), on the
tiny LM and a run published by the real Publisher; requests are real decode loops (and one a real HTTP stream).
vLLM's phases: tests/loader/engines/vllm/test_vllm_replica.py.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from ckptdelta.loader.engines.reference.model import SamplingParams, load_engine
from ckptdelta.loader.gate import ServingGate
from ckptdelta.loader.spans import VersionLog
from tests.replicas import PROMPT, lm_dir, run, start_replica, state_bits_equal  # noqa: F401


class PhaseGate(ServingGate):
    """The gate, calling ``at(phase)`` in each pause: "held" (no step runs, the old bits still in) and "set" (the
    new bits and version in, steps still held)."""

    def __init__(self) -> None:
        super().__init__()
        self.at = lambda phase: None

    @contextmanager
    def paused(self, timeout=None):
        with super().paused(timeout) as pause:
            self.at("held")
            yield pause
            self.at("set")


def _phase_gate(engine) -> PhaseGate:
    gate = PhaseGate()
    engine.gate = engine.swapper.gate = gate
    return gate


def _collapse(versions: list) -> list:
    return [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]


def _wait_queued(engine, n: int) -> None:
    """Until ``n`` requests wait for their next step (each admitted: its span is open before it queues)."""
    deadline = time.monotonic() + 60
    while engine.steps_waiting < n:
        assert time.monotonic() < deadline, f"{engine.steps_waiting} of {n} requests queued"
        time.sleep(0.001)


def test_a_span_keeps_every_version_served_through_any_number_of_swaps_in_the_order_served():
    log = VersionLog(0)
    whole = log.open()
    later = []
    for v in range(1, 301):
        log.serve(v)
        log.serve(v)                       # set again to what it is (a failed swap put it back): nothing new
        if v % 100 == 0:
            later.append(log.open())
    log.serve(None)                        # the weights' version became unknown
    log.serve(150)                         # a rollback to a version served before
    assert whole.close() == list(range(301)) + [None, 150]
    assert whole.close() == list(range(301)) + [None, 150]          # closing again: the same span
    assert [s.close() for s in later] == [list(range(v, 301)) + [None, 150] for v in (100, 200, 300)]
    assert log.open().close() == [150]
    with pytest.raises(ValueError):
        log.since(0)                       # nothing holds them any more: forgotten


def _requests_ending_at(engine, run, gate: PhaseGate, start: int, targets: list[int], q: int):
    """One request admitted at each phase point up to the serving point after swap ``q``, each taking its only
    step there. Returns, per request: (its point, the span it reported, the versions whose bits were in from
    its point to that step)."""
    if engine.version != start:
        engine.swapper.hotload(start)
    prompt = engine.encode(PROMPT)
    params = SamplingParams(max_tokens=1, temperature=0)
    bits_in: list[int] = []                 # at each point, the version whose bits the model holds
    outs: list = []
    threads: list[threading.Thread] = []

    def point(v: int) -> None:
        assert state_bits_equal(engine.model, run.truth[v]) == [], f"the bits of v{v} are not in at this point"
        bits_in.append(v)
        i = len(outs)
        outs.append(None)
        threads.append(threading.Thread(target=lambda: outs.__setitem__(i, engine.generate(prompt, params))))
        threads[-1].start()
        _wait_queued(engine, len(threads))

    with ExitStack() as hold:
        hold.enter_context(engine.hold())  # every request waits for its step until the end
        point(start)
        for prev, target in list(zip([start] + targets, targets))[:q]:
            gate.at = lambda phase, prev=prev, target=target: point(prev if phase == "held" else target)
            try:
                engine.swapper.hotload(target)
            finally:
                gate.at = lambda phase: None
            point(target)
    for t in threads:
        t.join(60)
    return [(i, outs[i].policy_versions, _collapse(bits_in[i:])) for i in range(len(outs))]


@pytest.mark.parametrize("start, targets", [(0, [1, 2, 3]), (1, [2, 1, 3])], ids=["forward", "with-a-rollback"])
def test_every_request_reports_the_versions_served_from_its_admission_to_its_last_step_at_every_phase_point_of_three_swaps(
        run, start, targets):
    """Admission at every point of up to three swaps (before, inside each pause with the old bits, inside it with the
    new ones, after), completion (the last step) at every point a step can run: the span is exactly the versions
    whose bits were in from the admission to the last step, the old one included when admitted in a pause. Every
    window of two and of one swap is among them."""
    engine, _ = load_engine(bucket=run.url, snapshot=start)
    gate = _phase_gate(engine)
    wrong = []
    for q in range(len(targets) + 1):
        for i, span, served in _requests_ending_at(engine, run, gate, start, targets, q):
            if span != served:
                wrong.append(f"admitted at point {i}, last step after swap {q}: reported {span}, served {served}")
    assert wrong == []


def test_a_stream_admitted_in_a_pause_reports_every_version_served_until_its_last_token(start_replica):
    """The reported case (issue 39) on the reference engine over HTTP: a stream admitted while the hot-load to v1
    is in its pause gets its first token from v1 alone, then waits while v2 and v3 are hot-loaded and gets its
    last token from v3: it reports v0 (served when it was admitted), v1, v2 (served while it waited) and v3."""
    rep = start_replica(0)
    engine = rep.engine
    gate = _phase_gate(engine)
    out: dict = {}

    def stream() -> None:
        with httpx.Client(base_url=rep.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True,
                                                           "stream": True, "return_engine_data": True}) as r:
                out["events"] = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]

    client = threading.Thread(target=stream)

    def admit_in_the_pause(phase: str) -> None:
        if phase == "held":
            client.start()
            _wait_queued(engine, 1)

    first_step = threading.Event()

    def hook(module, args, output):   # holds its first step open until the test has queued behind it
        if not first_step.is_set():
            first_step.set()
            _wait_queued(engine, 1)

    with ExitStack() as hold:
        hold.enter_context(engine.hold())
        gate.at = admit_in_the_pause
        assert rep.hotload(1)["state"] == "READY"
        gate.at = lambda phase: None
        handle = engine.model.register_forward_hook(hook)
    try:
        assert first_step.wait(60)        # its first token, from v1
        with engine.hold():               # between its two steps
            assert rep.hotload(2)["state"] == "READY" and rep.hotload(3)["state"] == "READY"
    finally:
        client.join(60)
        handle.remove()
    assert out["events"][-1] == "[DONE]"
    ed = json.loads(out["events"][-2])["engine_data"]
    assert ed["policy_versions"] == [0, 1, 2, 3] and ed["policy_version"] == 3 and ed["snapshot"] == "v00000003"
    assert ed["crossed_swap"] is True and ed["prefix_recomputes"] == 1
