"""The publisher a crash test kills: publishes version after version of weights it can regenerate.

``weights_for(seed, v)`` is a pure function of (seed, v), so the test knows the
exact bits of every version any child ever committed without being told, and a
restarted child continues a run without any state but the bucket. Consecutive
versions differ in about 2% of the elements of each float tensor (a delta of
a few KB); every ``anchor_every`` versions the publisher writes an anchor of
several shards plus an index and an extra file, so a run crosses every kind of
storage write.

A child reports what it does as JSON lines on fd 1 (one ``os.write`` each, so
lines of concurrent children never interleave): OPEN (the last committed
version it found), BEGIN v, COMMIT v kind, KILLSELF (just before it SIGKILLs
itself in "op" mode), ERROR, DONE.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import traceback
from typing import Any

import numpy as np
import torch

#: name -> (dtype, shape) of the crash-test model; about 200 KB in all.
SCHEMA: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "embed.weight": (torch.bfloat16, (256, 64)),
    "layers.0.attn.qkv": (torch.bfloat16, (64, 192)),
    "layers.0.mlp.up": (torch.bfloat16, (64, 256)),
    "layers.0.mlp.down": (torch.bfloat16, (256, 64)),
    "layers.0.norm": (torch.float32, (64,)),
    "layers.1.attn.qkv": (torch.bfloat16, (64, 192)),
    "layers.1.norm": (torch.float32, (64,)),
    "head.weight": (torch.float16, (256, 64)),
    "step": (torch.int64, (1,)),
}
CONFIG = b'{"model_type": "crash-test", "hidden_size": 64}'
ANCHOR_EVERY = 4
SHARD_BYTES = 48 << 10   # about five shards per anchor
WRITE_OPS = ("put", "put_file", "put_if_absent")


def _bits_dtype(dt: torch.dtype) -> torch.dtype:
    return {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.int64: torch.int64}[dt]


def base_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (dt, shape) in SCHEMA.items():
        if dt == torch.int64:
            out[name] = torch.zeros(shape, dtype=dt)
            continue
        t = (torch.randn(shape, generator=g) * 0.02).to(dt)
        ints = t.view(-1).view(_bits_dtype(dt))
        if dt == torch.bfloat16:   # bit patterns a float comparison gets wrong: NaN payload, -0.0, inf
            ints[:3] = torch.tensor([0x7FC3, -0x8000, 0x7F80], dtype=torch.int16)
        out[name] = t
    return out


def weights_for(seed: int, version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s exact weights: the base with ~1% of each float tensor's elements moved
    by a few ulps at positions drawn from (seed, version), and ``step`` = version."""
    out = base_weights(seed)
    for i, (name, t) in enumerate(out.items()):
        if t.dtype == torch.int64:
            t.fill_(version)
            continue
        ints = t.view(-1).view(_bits_dtype(t.dtype)).numpy()
        rng = np.random.default_rng([seed, version, i])
        idx = rng.choice(ints.size, size=max(1, ints.size // 100), replace=False)
        ints[idx] = ints[idx] + rng.integers(1, 4, size=idx.size).astype(ints.dtype)
    return out


def emit(ev: str, **fields: Any) -> None:
    line = json.dumps({"pid": os.getpid(), "ev": ev, "t": time.monotonic(), **fields}) + "\n"
    os.write(1, line.encode())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


def _install_kill_hook(store: Any, op: int, when: str, seed: int) -> None:
    """SIGKILL this process at the ``op``-th storage write: before it starts, once it returned,
    or after a random sub-millisecond delay while it runs ("during")."""
    count = [0]
    lock = threading.Lock()
    rng = random.Random(seed)

    def wrap(name: str) -> None:
        real = getattr(store, name)

        def hooked(key: str, *args: Any, **kwargs: Any) -> Any:
            with lock:
                count[0] += 1
                hit = count[0] == op
            if not hit:
                return real(key, *args, **kwargs)
            emit("KILLSELF", op=op, when=when, key=key, method=name)
            if when == "before":
                _die()
            if when == "during":
                delay = rng.uniform(0.0, 0.004)
                threading.Thread(target=lambda: (time.sleep(delay), _die()), daemon=True).start()
                out = real(key, *args, **kwargs)
                time.sleep(1.0)   # the timer fires while or right after the write runs
                return out
            out = real(key, *args, **kwargs)
            _die()
            return out

        setattr(store, name, hooked)

    for name in WRITE_OPS:
        wrap(name)


def run(cmd: dict[str, Any]) -> int:
    """Open the run (continuing after its last committed version), publish ``n_publish`` versions."""
    from ckptdelta.publisher import Publisher
    from ckptdelta.publisher.runs import committed_versions

    seed = int(cmd["seed"])
    pub = Publisher(cmd["url"], storage_options=cmd.get("storage_options") or {},
                    anchor_every=int(cmd.get("anchor_every", ANCHOR_EVERY)),
                    shard_bytes=int(cmd.get("shard_bytes", SHARD_BYTES)), extra_files={"config.json": CONFIG},
                    progress=False)
    versions = committed_versions(pub.store)
    last = versions[-1] if versions else None
    emit("OPEN", last=last, writer=pub.writer_id, run_id=pub.run_id)
    kill = cmd.get("kill")
    if kill:
        _install_kill_hook(pub.store, int(kill["op"]), kill["when"], seed ^ int(kill["op"]))
    nxt = 0 if last is None else last + 1
    for v in range(nxt, nxt + int(cmd["n_publish"])):
        emit("BEGIN", v=v)
        r = pub.publish(weights_for(seed, v), 10 * v)
        if r.version != v:
            emit("ERROR", error=f"publisher assigned version {r.version}, expected {v}")
            return 3
        emit("COMMIT", v=v, kind=r.kind)
    pub.close()
    emit("DONE")
    return 0


def child_main(cmd: dict[str, Any]) -> None:
    """Entry point of a forked child: never returns."""
    code = 4
    try:
        code = run(cmd)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which counts it as a violation
        emit("ERROR", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        code = 3
    finally:
        os._exit(code)
