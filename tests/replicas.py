"""Live replicas for tests: a published run of the tiny LM and the real app under uvicorn on 127.0.0.1.

Everything is real: the Publisher writes the run to a local-directory bucket,
the replica materializes and loads it with transformers, and tests talk to it
over HTTP on a real socket.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch
import uvicorn

from tests.lm import hf_extra_files, rl_step, save_tiny_lm

PROMPT = "hello world, hello replica"


@dataclass
class PublishedRun:
    """A run of the tiny LM: version v's exact weights are ``truth[v]``."""

    url: str
    lm_dir: str
    truth: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    publisher: object = None

    @property
    def latest(self) -> int:
        return max(self.truth)

    def publish_next(self, seed: int | None = None) -> int:
        """One more RL-like step, published as the next version."""
        prev = self.truth[self.latest]
        new = rl_step(prev, seed=seed if seed is not None else 1000 + self.latest)
        r = self.publisher.publish(new, self.latest + 1)
        self.truth[r.version] = {k: v.clone() for k, v in new.items()}
        return r.version

    def close(self) -> None:
        self.publisher.close()


def make_lm_dir(root: str) -> str:
    path = os.path.join(root, "tiny-lm")
    if not os.path.exists(os.path.join(path, "config.json")):
        save_tiny_lm(path)
    return path


def publish_run(url: str, lm_dir: str, *, n_versions: int = 4) -> PublishedRun:
    """Anchor the tiny LM as version 0 and publish ``n_versions - 1`` deltas after it."""
    from ckptdelta.publisher import Publisher
    from safetensors.torch import load_file

    weights = load_file(os.path.join(lm_dir, "model.safetensors"))
    run = PublishedRun(url, lm_dir, publisher=Publisher(url, extra_files=hf_extra_files(lm_dir)))
    r = run.publisher.publish(weights, 0)
    run.truth[r.version] = {k: v.clone() for k, v in weights.items()}
    for _ in range(n_versions - 1):
        run.publish_next()
    return run


class LiveServer:
    """An ASGI app served by uvicorn in a thread, on a free port of 127.0.0.1. ``drain``: the seconds a stop
    (``server.handle_exit``, what uvicorn does on SIGTERM) lets requests in flight finish before it cuts them."""

    def __init__(self, app, *, drain: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain,
                                limit_concurrency=256)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self.thread.ident is not None:     # a server never entered holds its port, bound, and no thread
            self.thread.join(timeout=15)
        self.sock.close()


def corrupt_delta(run: PublishedRun, version: int) -> str:
    """Flip one bit in the middle of a stored delta object of ``version``; returns its path."""
    deltas = os.path.join(run.url, "deltas")
    d = next(x for x in sorted(os.listdir(deltas)) if x.startswith(f"{version:012d}-"))
    path = os.path.join(deltas, d, sorted(os.listdir(os.path.join(deltas, d)))[0])
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0x40
    with open(path, "wb") as f:
        f.write(data)
    return path


def keys_led_by(replica_urls: list[str], url: str, n: int = 1) -> list[str]:
    """``n`` affinity keys whose own replica (the first of their order, rendezvous hashing over the fleet's URLs)
    is ``url``: which replica leads a given key hangs on the test's random ports, so tests choose keys, never
    assume them."""
    from ckptdelta.loader.client import RolloutClient

    with RolloutClient(replica_urls) as client:
        keys = (f"group-{i}" for i in range(100 * n + 1000))
        return [k for k in keys if client.replica_for(k) == url.rstrip("/")][:n]


def state_bits_equal(model: torch.nn.Module, truth: dict[str, torch.Tensor]) -> list[str]:
    """Names whose live bits differ from ``truth`` (empty when bit-identical)."""
    live = model.state_dict()
    bad = [k for k in truth if k not in live]
    for k, t in truth.items():
        if k in live:
            a, b = live[k].detach().cpu().contiguous(), t.contiguous()
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                bad.append(k)
    return bad


# --- fixtures (import them into a test module to use them) ----------------------------------------

@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_lm_dir(str(tmp_path_factory.mktemp("lm")))


@pytest.fixture(scope="module")
def run(tmp_path_factory, lm_dir):
    """A run with an anchor (v0) and three deltas (v1..v3); read-only for the tests that share it."""
    r = publish_run(str(tmp_path_factory.mktemp("bucket") / "run"), lm_dir, n_versions=4)
    yield r
    r.close()


class Replica:
    """A started replica, whatever its engine: the engine (in this process), the replica app on a live socket
    (uvicorn on 127.0.0.1), and an HTTP client for it. The one harness of the suite: the reference engine's
    tests, vLLM's (tests/vllm_replicas.py) and the engine conformance suite (tests/loader/engines/conformance.py)
    all start their replicas through it.

    ``listen=False``: the port is bound but refuses connections until :meth:`listen`, as ``serve``'s does until
    its checks end (then it answers STARTING until it serves: loader/starting.py)."""

    def __init__(self, engine, *, reader=None, replica_id: str = "r0", api_key: str | None = None,
                 listen: bool = True, timeout: float = 60.0):
        from ckptdelta.loader.server import create_app

        self.engine, self.reader = engine, reader
        self.server = LiveServer(create_app(engine, reader=reader, replica_id=replica_id, api_key=api_key))
        if listen:
            self.server.__enter__()
        self.url = self.server.url
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.http.post(path, json=body)

    def complete(self, **body) -> dict:
        r = self.post("/v1/completions", {"prompt": PROMPT, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def hotload(self, snapshot, *, wait: bool = True, timeout: float | None = None) -> dict:
        r = self.post("/v1/hotload", {"snapshot": snapshot})
        assert r.status_code in (200, 202), r.text
        return self.wait(r.json()["id"], timeout=timeout) if wait else r.json()

    def wait(self, job_id: str, states=("READY", "FAILED"), *, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            job = self.http.get(f"/v1/hotload/{job_id}").json()
            if job["state"] in states:
                return job
            assert time.monotonic() < deadline, job
            time.sleep(0.01)

    def status(self) -> dict:
        return self.http.get("/v1/status").json()

    def listen(self) -> "Replica":
        """Start serving a replica started with ``listen=False`` (until now its port refused connections)."""
        self.server.__enter__()
        return self

    def close(self) -> None:
        """Stop serving and release the engine (its processes, shared memory). Idempotent, as the engine's."""
        self.http.close()
        self.server.__exit__()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


@pytest.fixture
def start_replica(run):
    """Factory: a live replica of ``run`` (or another bucket) at a snapshot; stopped after the test."""
    started: list[Replica] = []

    from ckptdelta.loader.engines.reference.model import load_engine

    def start(snapshot="latest", *, bucket: str | None = None, model_dir: str | None = None,
              api_key: str | None = None, cache_policy: str = "recompute", replica_id: str = "r0",
              listen: bool = True) -> Replica:
        engine, reader = load_engine(bucket=bucket or run.url, snapshot=snapshot, model_dir=model_dir,
                                      cache_policy=cache_policy)
        rep = Replica(engine, reader=reader, replica_id=replica_id, api_key=api_key, listen=listen)
        started.append(rep)
        return rep

    yield start
    for rep in started:
        rep.close()


def held_after_first_step(engine):
    """(an event set at the engine's first forward step, the hook's handle): that step ends only once the test
    holds the next one (``engine.hold()``), so a decode loop is caught between its first and second token."""
    first_step = threading.Event()

    def hook(module, args, output):
        if not first_step.is_set():
            first_step.set()
            while engine.steps_waiting == 0:
                time.sleep(0.001)

    return first_step, engine.model.register_forward_hook(hook)
