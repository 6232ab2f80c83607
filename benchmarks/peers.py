"""The four ways to move a step's weights, trainer side and replica side, and the process that runs them.

``python -m benchmarks.peers URL OPTIONS_JSON SCRATCH`` is one host of
benchmarks/at_scale.py (a trainer or a replica, started inside its network
namespace): it reads one JSON command per line on stdin and answers one JSON
line on stdout (benchmarks.harness.serve). Times are ``time.monotonic()``, one clock for every process of
the machine, so the caller can take publish() called (trainer) -> swapped
(replica) across processes.

Methods, each a publish on the trainer and a hot-load into live torch tensors on
the replica (the same bucket, the same s3fs client options, one object per
tensor or per snapshot as the peers do):

- ``full``: ``safetensors.torch.save_file`` of the whole snapshot to local disk,
  ``put_file`` (s3fs multipart, 10 parts at once); ``get_file`` to local disk,
  ``load_file``, and ``copy_`` into the live tensors (the pause).
- ``xor``: old ^ new on raw bits, zstd-3 per tensor (benchmarks.baselines.XorZstd:
  slime, SkyRL, Fireworks), one object per tensor (``fs.pipe``/``fs.cat``, which
  run them concurrently); the replica decompresses every XOR mask while serving
  and XORs each whole tensor in place in the pause. The trainer keeps a host copy
  of the last published bits (as ckptdelta's publisher does) and updates it after
  encoding: that copy is part of its trainer-side time.
- ``idx``: changed positions as gaps in the smallest integer type + new values,
  zstd-3 per tensor (benchmarks.baselines.SparseIndexZstd: TRL, PULSE, prime-rl);
  the pause scatters the values.
- ``ckptdelta_auto`` / ``ckptdelta`` / ``ckptdelta_noctx``: ``Publisher(...).publish``
  with ``codec="auto"`` (the default), ``"context"`` or ``"fast"``, and
  ``ckptdelta.loader.HotSwapper.hotload``.

Snapshots travel between processes as flat files (:func:`save_flat`), mapped
read-only (:func:`open_flat`): the trainer's weights are page cache, not heap,
so a 4 GB model fits beside its replica on this machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any, Callable, TypeVar

import numpy as np
import torch
import xxhash

from benchmarks.harness import serve

T = TypeVar("T")

METHODS = ("full", "xor", "idx", "ckptdelta_auto", "ckptdelta", "ckptdelta_noctx")
LABELS = {"full": "full safetensors checkpoint", "xor": "XOR + zstd-3 per tensor",
          "idx": "indices + values, zstd-3", "ckptdelta_auto": "ckptdelta (default: auto)",
          "ckptdelta": "ckptdelta codec=context", "ckptdelta_noctx": "ckptdelta codec=fast"}
#: The Publisher codec of each ckptdelta method.
CODECS = {"ckptdelta_auto": "auto", "ckptdelta": "context", "ckptdelta_noctx": "fast"}


# --- snapshots as flat files -------------------------------------------------------------------

#: Tries of one baseline request: the same bound on transient faults (a reset, a short body) that
#: ckptdelta's Store applies, so a fault of the test server fails neither side of the comparison.
TRIES = 4


def retrying(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, retried like ckptdelta.delta.storage.Store retries (a transient error, backoff): the baselines'
    plain s3fs calls get the retries a user's client would have. Each retry is logged on stderr."""
    from ckptdelta.delta.storage import RetryPolicy, is_transient

    policy = RetryPolicy(attempts=TRIES)
    for attempt in range(1, TRIES + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified by is_transient
            if attempt == TRIES or not is_transient(e):
                raise
            print(f"{what}: transient error (try {attempt}/{TRIES}), retrying: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")


def save_flat(sd: dict[str, torch.Tensor], path: str) -> None:
    from benchmarks.baselines import to_bits

    index, off = [], 0
    with open(path + ".tmp", "wb") as f:
        for name in sorted(sd):
            t = sd[name]
            b = to_bits(t).view(np.uint8)
            f.write(memoryview(b))
            index.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                          "offset": off, "nbytes": b.nbytes})
            off += b.nbytes
    with open(path + ".json", "w") as f:
        json.dump(index, f)
    os.replace(path + ".tmp", path)


def open_flat(path: str) -> dict[str, torch.Tensor]:
    """Read-only tensors over the file's pages (writing one is a segfault, never a silent change)."""
    with open(path + ".json") as f:
        index = json.load(f)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        for e in index:
            raw = torch.from_numpy(mm[e["offset"]: e["offset"] + e["nbytes"]])
            out[e["name"]] = raw.view(getattr(torch, e["dtype"])).reshape(e["shape"])
    return out


def digests(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    from benchmarks.baselines import to_bits

    return {k: xxhash.xxh3_64_hexdigest(memoryview(to_bits(v).view(np.uint8))) for k, v in sorted(sd.items())}


def _bits(t: torch.Tensor) -> np.ndarray:
    from benchmarks.baselines import to_bits

    return to_bits(t)   # shares memory with the live tensor (contiguous)


# --- one host ----------------------------------------------------------------------------------

class Node:
    def __init__(self, url: str, opts: dict, scratch: str) -> None:
        import fsspec

        self.url, self.opts, self.scratch = url.rstrip("/"), opts, scratch
        self.fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **opts)
        self.base = self.url.split("://", 1)[1]
        self.snaps: dict[str, dict[str, torch.Tensor]] = {}
        self.prev: dict[str, torch.Tensor] | None = None   # trainer: last bits a baseline published
        self.live: dict[str, torch.Tensor] | None = None   # replica: the served weights
        self.pubs: dict[str, Any] = {}
        self.swappers: dict[str, Any] = {}
        os.makedirs(scratch, exist_ok=True)

    # --- set-up, untimed
    def op_load(self, labels: dict[str, str]) -> dict:
        for k, p in labels.items():
            self.snaps[k] = open_flat(p)
        return {"loaded": sorted(self.snaps)}

    def op_drop(self) -> dict:
        for p in self.pubs.values():
            p.close()
        self.pubs.clear()
        self.swappers.clear()
        self.snaps.clear()
        self.prev = self.live = None
        import gc
        gc.collect()
        return {}

    def op_digest(self, label: str | None = None) -> dict:
        return {"digests": digests(self.live if label is None else self.snaps[label])}

    def op_semantics(self) -> dict:
        from benchmarks import s3disk
        return s3disk.semantics(self.fs, f"{self.base}/probe")

    def op_throughput(self, objects: int, mb: int, repeats: int) -> dict:
        from benchmarks import s3disk
        return s3disk.throughput(self.fs, f"{self.base}/probe", objects=objects, mb=mb, repeats=repeats)

    def op_replica(self, base: str) -> dict:
        src = self.snaps[base]
        self.live = {k: v.clone() for k, v in src.items()}  # heap copy: the replica writes into it
        self.snaps.pop(base)
        return {"bytes": sum(t.numel() * t.element_size() for t in self.live.values())}

    def op_warm(self) -> dict:
        """Small publish/hot-load cycles on a local directory, both codec modes, sparse and dense steps,
        forward and back: numba's cached kernels, thread pools and imports load here, not in a timed step
        (a trainer or a replica pays them once per process)."""
        import tempfile

        from ckptdelta.loader import HotSwapper, SnapshotReader
        from ckptdelta.publisher import Publisher

        t = time.monotonic()
        g = torch.Generator().manual_seed(0)
        for context in (True, False):
            w0 = {f"w{i}": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(4)}
            live = {k: v.clone() for k, v in w0.items()}
            with tempfile.TemporaryDirectory(prefix="ckptdelta-warm-") as d:
                with Publisher(d, progress=False, context_coding=context) as pub:
                    v = pub.publish(w0, 0).version
                    sw = HotSwapper(live, SnapshotReader(d), version=v, progress=False)
                    for step, frac in enumerate((0.01, 0.01, 0.1, 0.1), start=1):
                        w = {k: x.clone() for k, x in w0.items()}
                        if step % 2:   # forward by ~frac of the elements, then back to w0
                            for x in w.values():
                                m = torch.rand(x.shape, generator=g) < frac
                                x[m] = (x[m].float() * (1 + 2 ** -6)).to(torch.bfloat16)
                        sw.hotload(pub.publish(w, step).version)
        return {"seconds": time.monotonic() - t}

    def op_attach(self, run: str, version: int, cache_dir: str | None) -> dict:
        from ckptdelta.loader import DiskCache, HotSwapper, SnapshotReader

        sw = self.swappers.get(run)
        if sw is not None and sw.version == version:   # keep its manifests; only the host cache changes
            sw.reader.cache = DiskCache(cache_dir) if cache_dir else None
            return {}
        reader = SnapshotReader(f"{self.url}/{run}", storage_options=self.opts, cache_dir=cache_dir)
        self.swappers[run] = HotSwapper(self.live, reader, version=version, progress=False)
        return {}

    def op_anchor(self, run: str, base: str, codec: str) -> dict:
        from ckptdelta.publisher import Publisher

        pub = Publisher(f"{self.url}/{run}", storage_options=self.opts, progress=False, anchor_every=1000,
                        anchor_chain_fraction=100.0, codec=codec)
        self.pubs[run] = pub
        t = time.monotonic()
        res = pub.publish(self.snaps[base], 0)
        return {"version": res.version, "stored_bytes": res.stored_bytes, "seconds": time.monotonic() - t}

    # --- the timed parts
    def op_publish(self, method: str, target: str, run: str, step: int) -> dict:
        new = self.snaps[target]
        prefix = f"{self.base}/{run}/step-{step:06d}"
        t0 = time.monotonic()
        if method == "full":
            from safetensors.torch import save_file

            local = os.path.join(self.scratch, "trainer-full.safetensors")
            save_file(new, local)
            t1 = time.monotonic()
            key = f"{prefix}/model.safetensors"
            retrying(f"put {key}", lambda: self.fs.put_file(local, key))
            t2 = time.monotonic()
            nbytes = os.path.getsize(local)
            os.unlink(local)
            return {"t0": t0, "t_end": t2, "trainer_s": t1 - t0, "upload_s": t2 - t1, "bytes": nbytes, "keys": [key]}
        if method in ("xor", "idx"):
            from benchmarks.baselines import SparseIndexZstd, XorZstd

            if self.prev is None:   # the host copy of what was published last; built untimed, once
                raise RuntimeError("publish xor/idx: call op_prev first")
            codec = XorZstd(3) if method == "xor" else SparseIndexZstd(3)
            blobs = codec.encode(self.prev, new)
            for k, t in new.items():   # the next step's parent, as a real trainer must keep it
                self.prev[k].copy_(t)
            t1 = time.monotonic()
            names = sorted(new)
            keys = [f"{prefix}/{i:05d}" for i in range(len(names))]
            retrying(f"pipe {prefix}", lambda: self.fs.pipe(dict(zip(keys, blobs))))
            t2 = time.monotonic()
            return {"t0": t0, "t_end": t2, "trainer_s": t1 - t0, "upload_s": t2 - t1,
                    "bytes": sum(len(b) for b in blobs), "keys": keys}
        if method in CODECS:
            res = self.pubs[run].publish(new, step)
            t2 = time.monotonic()
            return {"t0": t0, "t_end": t2, "trainer_s": res.copy_s + res.encode_s,
                    "upload_s": res.upload_s + res.commit_s, "bytes": res.stored_bytes, "version": res.version,
                    "kind": res.kind, "codec": res.codec}
        raise ValueError(method)

    def op_prev(self, base: str) -> dict:
        self.prev = {k: v.clone() for k, v in self.snaps[base].items()}
        return {}

    def op_release_prev(self) -> dict:
        self.prev = None
        return {}

    def op_release_run(self, run: str) -> dict:
        pub = self.pubs.pop(run, None)
        if pub is not None:
            pub.close()
        self.swappers.pop(run, None)
        import gc
        gc.collect()
        return {}

    def op_hotload(self, method: str, info: dict, run: str) -> dict:
        t0 = time.monotonic()
        live = self.live
        if method == "full":
            from safetensors.torch import load_file

            local = os.path.join(self.scratch, "replica-full.safetensors")
            retrying(f"get {info['keys'][0]}", lambda: self.fs.get_file(info["keys"][0], local))
            t1 = time.monotonic()
            loaded = load_file(local)
            t2 = time.monotonic()
            with torch.no_grad():
                for k, t in loaded.items():
                    live[k].copy_(t)
            t3 = time.monotonic()
            del loaded
            os.unlink(local)
            return {"fetch_s": t1 - t0, "decode_s": t2 - t1, "pause_s": t3 - t2, "t_swapped": t3,
                    "bytes_fetched": info["bytes"]}
        if method in ("xor", "idx"):
            import zstandard

            names = sorted(live)
            got = retrying(f"cat {len(info['keys'])} keys", lambda: self.fs.cat(info["keys"]))
            blobs = [got[k] for k in info["keys"]]
            del got
            t1 = time.monotonic()
            dz = zstandard.ZstdDecompressor()
            staged = []
            for n, b in zip(names, blobs):
                lb = _bits(live[n])
                if method == "xor":
                    x = np.frombuffer(dz.decompress(b, max_output_size=lb.nbytes), dtype=lb.dtype)
                    if x.size != lb.size:
                        raise ValueError(f"{n}: XOR mask of {x.size} elements for {lb.size}")
                    staged.append((lb, x))
                else:
                    rec = dz.decompress(b, max_output_size=9 + lb.size * (8 + lb.itemsize))
                    count, gw = np.frombuffer(rec, dtype="<u8", count=1)[0], rec[8]
                    gaps = np.frombuffer(rec, dtype=f"<u{gw}", count=int(count), offset=9)
                    vals = np.frombuffer(rec, dtype=lb.dtype, count=int(count), offset=9 + int(count) * gw)
                    idx = np.cumsum(gaps, dtype=np.int64) - 1
                    if count and not (0 <= idx[0] and idx[-1] < lb.size):
                        raise ValueError(f"{n}: index out of range")
                    staged.append((lb, (idx, vals)))
            t2 = time.monotonic()
            for lb, s in staged:     # the pause: every tensor written before serving again
                if method == "xor":
                    np.bitwise_xor(lb, s, out=lb)
                else:
                    lb[s[0]] = s[1]
            t3 = time.monotonic()
            return {"fetch_s": t1 - t0, "decode_s": t2 - t1, "pause_s": t3 - t2, "t_swapped": t3,
                    "bytes_fetched": sum(len(b) for b in blobs)}
        if method in CODECS:
            sw = self.swappers[run]
            before = dict(sw.reader.stats)
            rep = sw.hotload(info["version"])
            t3 = time.monotonic()
            return {"fetch_s": rep.fetch_s, "decode_s": rep.decode_s, "pause_s": rep.pause_s, "t_swapped": t3,
                    "bytes_fetched": rep.bytes_fetched, "hotload_s": t3 - t0,
                    "reader": {k: sw.reader.stats[k] - before.get(k, 0) for k in sw.reader.stats}}
        raise ValueError(method)


def main(argv: list[str] | None = None) -> int:
    url, opts, scratch = (argv or sys.argv[1:])[:3]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return serve(Node(url, json.loads(opts), scratch))


if __name__ == "__main__":
    raise SystemExit(main())
