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

import torch
import uvicorn

from tests.lm import hf_extra_files, rl_step, save_tiny_lm


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
    from publisher import Publisher
    from safetensors.torch import load_file

    weights = load_file(os.path.join(lm_dir, "model.safetensors"))
    run = PublishedRun(url, lm_dir, publisher=Publisher(url, extra_files=hf_extra_files(lm_dir)))
    r = run.publisher.publish(weights, 0)
    run.truth[r.version] = {k: v.clone() for k, v in weights.items()}
    for _ in range(n_versions - 1):
        run.publish_next()
    return run


class LiveServer:
    """An ASGI app served by uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, limit_concurrency=256)
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
        self.thread.join(timeout=15)
        self.sock.close()


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
