"""A sampling load for benchmarks/lora.py: streaming clients whose token arrival times show when vLLM stops.

A few threads, each streaming ``/v1/completions`` back to back to the current
*target* (a URL and a model name; the benchmark points them at the adapter of the
method it measures). Every streamed token is timed on arrival (``time.perf_counter``:
CLOCK_MONOTONIC on Linux, one clock for every process of the machine), every
request logged with how it ended. From these logs :func:`stall` finds the longest
interval without any streamed chunk overlapping a window (the time vLLM did not
generate while an adapter was written) and :func:`rate` the tokens per second inside a window.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from benchmarks import harness

PROMPT = "hello world, hello replica"


class StreamLoad(harness.Clients):
    """``clients`` threads streaming completions of ``max_tokens`` tokens (ignore_eos) to the current target."""

    stop_timeout = 120.0

    def __init__(self, clients: int, max_tokens: int):
        super().__init__(clients)
        self.max_tokens = max_tokens
        self.chunks: list[float] = []                 # arrival time of every streamed chunk of tokens
        self.tokens: list[tuple[float, float]] = []   # (arrival, tokens it carried) once its request ended
        self.requests: list[dict[str, Any]] = []      # one per finished (or failed) request
        self._target: dict[str, Any] | None = None

    def target(self, label: str, url: str, model: str, *, engine_data: bool = False,
               client: httpx.Client | None = None) -> None:
        """New requests go to ``model`` at ``url`` (``client`` when it must be a special one, e.g. a unix socket)."""
        self._target = {"label": label, "url": url, "model": model, "engine_data": engine_data, "client": client}

    def _loop(self, i: int) -> None:
        clients: dict[str, httpx.Client] = {}
        n = 0
        try:
            while not self._stop.is_set():
                tgt = self._target
                if tgt is None:
                    time.sleep(0.05)
                    continue
                n += 1
                c = tgt["client"] or clients.get(tgt["url"])
                if c is None:
                    c = clients[tgt["url"]] = httpx.Client(base_url=tgt["url"], timeout=300)
                self.requests.append(self._one(c, tgt, f"{PROMPT} {i} {n}", seed=1000 * i + n))
        finally:
            for c in clients.values():
                c.close()

    def _one(self, c: httpx.Client, tgt: dict[str, Any], prompt: str, seed: int) -> dict[str, Any]:
        body = {"model": tgt["model"], "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 1.0, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
        if tgt["engine_data"]:
            body["return_engine_data"] = True
        rec: dict[str, Any] = {"label": tgt["label"], "t0": time.perf_counter(), "tokens": 0, "chunks": 0,
                               "finish": None, "error": None, "versions": None}
        times: list[float] = []
        try:
            with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    rec["error"] = f"{r.status_code}: {r.text[:200]}"
                else:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            rec["error"] = str(chunk["error"])[:200]
                            continue
                        if chunk.get("engine_data"):
                            rec["versions"] = chunk["engine_data"].get("policy_versions")
                        if chunk.get("usage"):
                            rec["tokens"] = int(chunk["usage"].get("completion_tokens") or 0)
                        for ch in chunk.get("choices") or ():
                            # every choice vLLM streams carries new tokens, even with no text: a random model's
                            # tokens mostly decode to none (only the usage chunk at the end has no choice)
                            self.chunks.append(time.perf_counter())
                            times.append(self.chunks[-1])
                            if ch.get("finish_reason"):
                                rec["finish"] = ch["finish_reason"]
        except (httpx.HTTPError, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        rec["t1"] = time.perf_counter()
        rec["chunks"] = len(times)
        rec["first"], rec["last"] = (times[0], times[-1]) if times else (None, None)
        rec["tokens"] = rec["tokens"] or len(times)
        w = rec["tokens"] / len(times) if times else 0.0     # a chunk may carry several tokens
        self.tokens.extend((t, w) for t in times)
        if rec["error"] is None and rec["finish"] not in ("length", "stop"):
            rec["error"] = f"ended with finish_reason {rec['finish']!r}"
        return rec


def stall(tokens: list[float], w0: float, w1: float) -> float:
    """The longest interval without any streamed chunk that overlaps [w0, w1] (0 when none around it)."""
    best = 0.0
    prev = None
    for t in tokens:
        if prev is not None and t > w0 and prev < w1:
            best = max(best, t - prev)
        if prev is not None and prev >= w1:
            break
        prev = t
    return best


def rate(tokens: list[tuple[float, float]], w0: float, w1: float) -> float:
    """Streamed tokens per second inside [w0, w1] (``tokens``: arrival time, tokens carried)."""
    if w1 <= w0:
        return 0.0
    return sum(n for t, n in tokens if w0 <= t < w1) / (w1 - w0)


def gaps(tokens: list[float], windows: list[tuple[float, float]]) -> list[float]:
    """Every interval between consecutive streamed tokens that lies inside one of ``windows``."""
    out = []
    for a, b in zip(tokens, tokens[1:]):
        if any(w0 <= a and b <= w1 for w0, w1 in windows):
            out.append(b - a)
    return out
