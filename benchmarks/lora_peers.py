"""The trainer and the replica of benchmarks/lora.py, each a process inside its own network namespace.

``python -m benchmarks.lora_peers ROLE URL OPTIONS_JSON SCRATCH`` (ROLE ``trainer`` or
``replica``) reads one JSON command per line on stdin and answers one JSON line on
stdout (benchmarks.harness.serve), like benchmarks/peers.py. Times are
``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: one clock for both processes, so
publish() called on the trainer -> serving on the replica spans them).

The three methods, trainer side and replica side, all on the same adapter bits:

- ``ckptdelta``: ``Publisher.publish(peft_model, step)`` -> ``POST /v1/hotload`` (answered as the job ends) on the
  replica app over ``build_engine("vllm")`` (a LoRA run: the new version written
  into a free slot by one collective RPC, proven, then routed to) -> job READY.
- ``full``: the whole adapter every step (``safetensors`` of the peft state dict +
  ``adapter_config.json``) to ``full/<step>/`` in the bucket; the replica downloads
  the directory and calls vLLM's ``POST /v1/load_lora_adapter`` with
  ``load_inplace: true`` (Fireworks, TRL, ART).
- ``xor``: XOR of the raw bits against the last published adapter, zstd-3 per tensor,
  one object per step (``xor/<step>.bin``: a JSON index, then the frames); the
  replica XORs it into its copy of the adapter, writes a full adapter directory and
  loads it the same way (SkyRL, slime).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks.baselines import from_bits, to_bits
from benchmarks.harness import serve
from benchmarks.peers import digests

log = logging.getLogger("ckptdelta.bench.lora")

METHODS = ("ckptdelta", "full", "xor")
LABELS = {"ckptdelta": "(a) ckptdelta", "full": "(b) full adapter + load_lora_adapter(load_inplace)",
          "xor": "(c) XOR + zstd-3 delta -> adapter dir + load_lora_adapter(load_inplace)"}
#: The names the baselines' adapters get in vLLM.
BASELINE_NAMES = {"full": "bench-full-adapter", "xor": "bench-xor-adapter"}
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _fs(url: str, opts: dict) -> tuple[Any, str]:
    import fsspec

    if "://" not in url:        # a local-directory bucket: parents made as objects are written
        return fsspec.filesystem("file", auto_mkdir=True), url
    # a client of its own (no instance or listings cache shared with ckptdelta's reader in this process)
    return fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False, **opts)


# --- the trainer --------------------------------------------------------------------------------------------

class Trainer:
    """A peft LoRA adapter on every linear layer of the base, AdamW on real gradients; the three publishers."""

    def __init__(self, url: str, opts: dict, scratch: str) -> None:
        self.url, self.opts, self.scratch = url.rstrip("/"), opts, scratch
        self.fs, self.root = _fs(self.url, opts)
        self.model = self.opt = self.pub = None
        self.prev: dict[str, np.ndarray] = {}

    def op_init(self, base_dir: str, rank: int, prefix: str, warmup: int, lr: float, dtype: str,
                batch: list[int], threads: int = 1, seed: int = 0, codec: str | None = None,
                keep_exact: bool = False) -> dict:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from ckptdelta.publisher import AdapterSpec, BaseModel, Publisher

        self.op_close()
        torch.set_num_threads(threads)     # the trainer leaves the replica's vLLM its cores (--trainer-threads)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        # The bf16 base upcast to fp32 (exact): this CPU torch's bf16 matmuls run 5-80x slower than fp32 ones (a
        # step of the 0.51 GB base took ~25 s on one thread against ~0.6 s), and the gradients are as real.
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
        self.model = get_peft_model(base, cfg)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                     weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.batch, self.steps = tuple(batch), 0
        self.dtype = torch.bfloat16 if dtype == "bf16" else None
        self.prefix = prefix
        warm = [self.op_train(lr)["train_s"] for _ in range(warmup)]
        cfg_dir = os.path.join(self.scratch, f"{prefix}-config")
        self.model.save_pretrained(cfg_dir)           # peft's own adapter_config.json
        with open(os.path.join(cfg_dir, CONFIG), "rb") as f:
            self.config = f.read()
        if not self.config:
            raise RuntimeError(f"peft wrote an empty {CONFIG} in {cfg_dir}")
        # the run records the bf16 base directory the replica serves, not the trainer's fp32 copy of it
        # keep_exact: ckptdelta publishes the bf16 vLLM keeps and attaches the fp32 bits after each commit, while
        # the baselines ship the fp32 adapter
        self.keep_exact = keep_exact
        self.pub = Publisher(f"{self.url}/{prefix}/ckptdelta", storage_options=self.opts,
                             dtype=torch.bfloat16 if keep_exact else self.dtype, keep_exact=keep_exact,
                             adapter=AdapterSpec(cfg, BaseModel.of(base_dir)), codec=codec)
        r = self.pub.publish(self.model, self.steps)            # the anchor every method starts from
        sd = self.adapter()
        self._put_full(sd, self.steps)
        self.prev = {k: to_bits(v).copy() for k, v in sd.items()}
        n = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"version": r.version, "step": self.steps, "adapter_params": n,
                "adapter_bytes": sum(t.numel() * t.element_size() for t in sd.values()),
                "tensors": len(sd), "warmup_train_s": warm, "init_s": time.perf_counter() - t0,
                "digests": digests(sd)}

    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter as the methods publish it (peft's saved names; cast like Publisher(dtype=...))."""
        from peft import get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.model)
        return {k: (v.detach().to(self.dtype) if self.dtype else v.detach()).contiguous().clone()
                for k, v in sd.items()}

    def op_train(self, lr: float) -> dict:
        """One AdamW step at ``lr`` on the next-token loss of a random batch (every lora_A and lora_B moves)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        t0 = time.perf_counter()
        x = torch.randint(0, self.model.config.vocab_size, self.batch, generator=self.gen)
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1
        return {"step": self.steps, "train_s": time.perf_counter() - t0, "loss": loss.item(),
                "digests": digests(self.adapter())}

    def _put_full(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        from safetensors.torch import save

        t0 = time.perf_counter()
        blob = save(sd, metadata={"format": "pt"})
        t1 = time.perf_counter()
        d = f"{self.root}/{self.prefix}/full/{step}"
        self.fs.pipe({f"{d}/{WEIGHTS}": blob, f"{d}/{CONFIG}": self.config})
        return t1 - t0, time.perf_counter() - t1

    def op_publish(self, method: str) -> dict:
        t0 = time.perf_counter()
        if method == "ckptdelta":
            r = self.pub.publish(self.model, self.steps)
            t1 = time.perf_counter()
            return {"t0": t0, "t_end": t1, "publish_s": t1 - t0, "trainer_s": r.copy_s + r.encode_s,
                    "upload_s": r.upload_s + r.commit_s, "version": r.version, "kind": r.kind,
                    "payload": r.stored_bytes, "codec": r.codec, "threads": r.encode_threads}
        sd = self.adapter()
        t_get = time.perf_counter() - t0
        if method == "full":
            ser, up = self._put_full(sd, self.steps)
            t1 = time.perf_counter()
            return {"t0": t0, "t_end": t1, "publish_s": t1 - t0, "trainer_s": t_get + ser, "upload_s": up,
                    "step": self.steps}
        if method == "xor":
            import zstandard

            t = time.perf_counter()
            cz = zstandard.ZstdCompressor(level=3)
            names, frames, meta = sorted(sd), [], []
            for n in names:
                b = to_bits(sd[n])
                frames.append(cz.compress(np.bitwise_xor(self.prev[n], b).tobytes()))
                self.prev[n] = b.copy()                 # the trainer's copy of the last published bits
                meta.append({"name": n, "dtype": str(sd[n].dtype).replace("torch.", ""),
                             "shape": list(sd[n].shape), "nbytes": len(frames[-1])})
            head = json.dumps({"step": self.steps, "tensors": meta}).encode()
            blob = len(head).to_bytes(8, "little") + head + b"".join(frames)
            t_enc = time.perf_counter() - t
            t = time.perf_counter()
            self.fs.pipe_file(f"{self.root}/{self.prefix}/xor/{self.steps}.bin", blob)
            t1 = time.perf_counter()
            return {"t0": t0, "t_end": t1, "publish_s": t1 - t0, "trainer_s": t_get + t_enc, "upload_s": t1 - t,
                    "step": self.steps, "payload": len(blob)}
        raise ValueError(method)

    def op_settle(self, version: int) -> dict:
        """After a step of ckptdelta's is served: wait for what its publish left running (keep_exact: the fp32
        attachment), untimed, and check that the attachment rebuilds the trainer's fp32 adapter bit for bit."""
        t0 = time.perf_counter()
        self.pub.wait_until_finished()
        waited = time.perf_counter() - t0
        if not self.keep_exact:
            return {"settle_s": waited, "exact": None}
        from ckptdelta.loader import SnapshotReader

        got = SnapshotReader(f"{self.url}/{self.prefix}/ckptdelta", storage_options=self.opts).read_exact(version)
        return {"settle_s": waited, "exact": digests(got) == digests(self.adapter())}

    def op_close(self) -> dict:
        if self.pub is not None:
            self.pub.close()
        self.model = self.opt = self.pub = None
        return {}

    op_drop = op_close


# --- the replica ---------------------------------------------------------------------------------------------

class Replica:
    """One vLLM (CPU build) started by ckptdelta's LoRA engine, its replica app, the sampling load, and the
    baselines' adapters loaded into the same vLLM by name."""

    def __init__(self, url: str, opts: dict, scratch: str) -> None:
        self.url, self.opts, self.scratch = url.rstrip("/"), opts, scratch
        self.fs, self.root = _fs(self.url, opts)
        self.engine = self.server = self.http = self.load = self.vllm = None
        self.held: dict[str, np.ndarray] = {}
        self.dirs = 0

    def op_start(self, prefix: str, step: int, base_dir: str, vllm_args: list[str], slots: int, clients: int,
                 max_tokens: int, vllm_log: str) -> dict:
        """vLLM on the base serving the run's first version (the anchor) in ckptdelta's slots and, by name, the
        baselines' adapters of the same step (their first load, not in place)."""
        from ckptdelta.loader.engines import build_engine
        from ckptdelta.loader.engines.vllm.control import http_client
        from ckptdelta.loader.server import create_app
        from tests.replicas import LiveServer

        from benchmarks.lora_load import StreamLoad

        self.op_stop()
        self.prefix = prefix
        t0 = time.perf_counter()
        self.engine = build_engine("vllm", bucket=f"{self.url}/{prefix}/ckptdelta", snapshot=0,
                                   storage_options=self.opts, base_model=base_dir, lora_slots=slots,
                                   vllm_args=vllm_args, vllm_log=vllm_log)
        t1 = time.perf_counter()
        self.server = LiveServer(create_app(self.engine, replica_id="lora-bench")).__enter__()
        import httpx

        self.http = httpx.Client(base_url=self.server.url, timeout=300)
        self.vllm = http_client(self.engine.url, timeout=300)
        self.load_client = http_client(self.engine.url, timeout=300)
        local = self._download_full(step)
        self.ids: dict[str, int] = {}       # each baseline adapter's id in vLLM (its first load registers it)
        for m in ("full", "xor"):
            before = set(self._ids())
            self._load_adapter(m, local, inplace=False)
            new = set(self._ids()) - before
            if len(new) != 1:
                raise RuntimeError(f"loading {BASELINE_NAMES[m]} registered {sorted(new)} in vLLM, not one id")
            self.ids[m] = new.pop()
        from safetensors.torch import load_file

        self.held = {k: to_bits(v).copy() for k, v in load_file(os.path.join(local, WEIGHTS)).items()}
        with open(os.path.join(local, CONFIG), "rb") as f:
            self.config = f.read()
        self.load = StreamLoad(clients, max_tokens)
        self.load.start()
        self.op_target("ckptdelta")
        from ckptdelta.loader.heap import freeze_started_heap

        freeze_started_heap()           # as `ckptdelta serve` does once its replica serves
        return {"vllm_start_s": t1 - t0, "ids": self._ids()}

    # -- what the sampling load asks for
    def op_target(self, method: str, settle: float = 0.0) -> dict:
        if method == "ckptdelta":
            self.load.target(method, self.server.url, self.engine.model_name, engine_data=True)
        else:
            self.load.target(method, "vllm", BASELINE_NAMES[method], client=self.load_client)
        t0 = time.perf_counter()
        time.sleep(settle)
        return {"idle": [t0, time.perf_counter()]}

    # -- the baselines' pieces
    def _download_full(self, step: int) -> str:
        self.dirs += 1
        local = os.path.join(self.scratch, f"{self.prefix}-full-{step}-{self.dirs}")
        os.makedirs(local)
        d = f"{self.root}/{self.prefix}/full/{step}"
        got = self.fs.cat([f"{d}/{WEIGHTS}", f"{d}/{CONFIG}"])
        for k, v in got.items():
            with open(os.path.join(local, k.rsplit("/", 1)[-1]), "wb") as f:
                f.write(v)
        return local

    def _load_adapter(self, method: str, path: str, *, inplace: bool) -> tuple[float, float]:
        body = {"lora_name": BASELINE_NAMES[method], "lora_path": path}
        if inplace:
            body["load_inplace"] = True
        t0 = time.perf_counter()
        r = self.vllm.post("/v1/load_lora_adapter", json=body)
        t1 = time.perf_counter()
        if r.status_code != 200:
            raise RuntimeError(f"load_lora_adapter {body}: {r.status_code} {r.text[:300]}")
        return t0, t1

    def _xor_dir(self, step: int) -> str:
        import zstandard
        from safetensors.torch import save_file

        blob = self.fs.cat_file(f"{self.root}/{self.prefix}/xor/{step}.bin")
        n = int.from_bytes(blob[:8], "little")
        head = json.loads(blob[8:8 + n])
        dz = zstandard.ZstdDecompressor()
        off, out = 8 + n, {}
        for e in head["tensors"]:
            held = self.held[e["name"]]
            x = np.frombuffer(dz.decompress(blob[off:off + e["nbytes"]], max_output_size=held.nbytes),
                              dtype=held.dtype)
            off += e["nbytes"]
            np.bitwise_xor(held, x, out=held)
            out[e["name"]] = from_bits(held, getattr(torch, e["dtype"]), e["shape"])
        self.dirs += 1
        local = os.path.join(self.scratch, f"{self.prefix}-xor-{step}-{self.dirs}")
        os.makedirs(local)
        save_file(out, os.path.join(local, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(local, CONFIG), "wb") as f:
            f.write(self.config)
        return local

    def _await_objects(self, paths: list[str], timeout: float = 120.0) -> None:
        """Until every one of ``paths`` exists (a HEAD each, every 10 ms): a baseline told of a step before its
        upload ends starts fetching the moment its objects are there."""
        deadline = time.monotonic() + timeout
        while True:
            self.fs.invalidate_cache()
            if all(self.fs.exists(p) for p in paths):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{paths} did not appear within {timeout:g} s")
            time.sleep(0.01)

    def op_hotload(self, method: str, info: dict, early: bool = False) -> dict:
        """Load the step ``info`` names; ``early``: it is being published now (its objects may not exist yet)."""
        t0 = time.perf_counter()
        if method == "ckptdelta":
            # answered once the job ends (``wait``): one request from the hot-load's start to READY
            body = {"snapshot": info["version"], "wait": 30, **({"await_commit_s": 120.0} if early else {})}
            r = self.http.post("/v1/hotload", json=body)
            if r.status_code not in (200, 202):
                raise RuntimeError(f"hotload {info['version']}: {r.status_code} {r.text[:300]}")
            job = r.json()
            while job["state"] not in ("READY", "FAILED"):     # past the wait: asked again, answered as it ends
                job = self.http.get(f"/v1/hotload/{job['id']}?wait=30").json()
            t1 = time.perf_counter()
            if job["state"] != "READY":
                raise RuntimeError(f"hotload {info['version']} failed: {job}")
            last = self.engine.applier.last
            p = self.engine.applier._pause          # the Pause of this hot-load: when the write began, its length
            started = p.started
            # the write's own time in each worker (its preparation and its proof ran beside vLLM's steps)
            held = [w["held_s"] if w.get("held_s") is not None else
                    sum(w.get(k) or 0.0 for k in ("transform_s", "write_s", "prove_s")) for w in last["workers"]]
            # what the write is waited for: the step in progress (the lock vLLM's steps hold), then the copy
            wait = max(w.get("lock_wait_s") or 0.0 for w in last["workers"])
            return {"t_serving": t1, "rpc": [started - wait, started + last["pause_s"]],
                    "prepare": [t0, started - wait],
                    "pause_rpc_s": wait + last["pause_s"], "hold_s": max(held),
                    "prove_s": max(w.get("prove_s") or 0.0 for w in last["workers"]),
                    "workers": last["workers"], "slot": last["slot"],
                    "serving_version": self.engine.version, "proven": last.get("proven"),
                    "report": job.get("report"), "bytes_landed": job.get("bytes_landed")}
        if method == "full":
            if early:
                d = f"{self.root}/{self.prefix}/full/{info['step']}"
                self._await_objects([f"{d}/{WEIGHTS}", f"{d}/{CONFIG}"])
            local = self._download_full(info["step"])
        else:
            if early:
                self._await_objects([f"{self.root}/{self.prefix}/xor/{info['step']}.bin"])
            local = self._xor_dir(info["step"])
        r0, r1 = self._load_adapter(method, local, inplace=True)
        # the same in-place load again, run by the worker itself and timed there: how long it holds the engine loop
        answers = self.engine.applier.control.rpc(
            "ckptdelta_lora_load_dir", {"name": BASELINE_NAMES[method], "id": self.ids[method], "path": local})
        from safetensors.torch import load_file

        return {"t_serving": r1, "rpc": [r0, r1], "prepare": [t0, r0], "pause_rpc_s": r1 - r0,
                "hold_s": max(a["load_s"] for a in answers), "workers": answers,
                "digests": digests(load_file(os.path.join(local, WEIGHTS)))}

    def _ids(self) -> list[int]:
        return self.engine.applier.control.rpc("ckptdelta_lora_slots", {})[0]["registered"]

    def op_check(self, methods: list[str]) -> dict:
        """Untimed: the LoRA buffers vLLM holds for the adapter of each baseline in ``methods`` (those this run
        loads every step; after one request on it) and for the ckptdelta slot serving, bit for bit (each must hold
        the same version as ckptdelta's slot by now)."""
        for name in (BASELINE_NAMES[m] for m in methods):   # a request on each first: vLLM activates it in a slot
            r = self.vllm.post("/v1/completions", json={"model": name, "prompt": "check", "max_tokens": 1})
            if r.status_code != 200:
                raise RuntimeError(f"a request on {name}: {r.status_code} {r.text[:200]}")
        ctl = self.engine.applier.control
        serving = self.engine.slots.newest().id
        want = ctl.rpc("ckptdelta_lora_digests", {"id": serving})[0]["digests"]
        out = {}
        for i in sorted(self.ids[m] for m in methods):
            try:
                got = ctl.rpc("ckptdelta_lora_digests", {"id": i})[0]["digests"]
                out[str(i)] = got == want
            except Exception as e:  # noqa: BLE001 - an adapter not in a slot right now: say so
                out[str(i)] = f"{type(e).__name__}: {e}"[:200]
        return {"same_as_ckptdelta_slot": out}

    def op_stop(self) -> dict:
        from ckptdelta.loader.heap import unfreeze_heap

        unfreeze_heap()                 # what this replica held may be collected once it is stopped
        out: dict[str, Any] = {}
        if self.load is not None:
            self.load.stop()
            out = {"chunks": self.load.chunks, "tokens": self.load.tokens, "requests": self.load.requests}
            self.load = None
        for c in (self.http, self.vllm, getattr(self, "load_client", None)):
            if c is not None:
                c.close()
        if self.server is not None:
            self.server.__exit__(None, None, None)
        if self.engine is not None:
            self.engine.close()
        self.engine = self.server = self.http = self.vllm = self.load_client = None
        return out

    op_drop = op_stop


def main(argv: list[str] | None = None) -> int:
    role, url, opts, scratch = (argv or sys.argv[1:])[:4]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(scratch, exist_ok=True)
    node = {"trainer": Trainer, "replica": Replica}[role](url, json.loads(opts), scratch)
    return serve(node, hello={"ok": True, "ready": role})

if __name__ == "__main__":
    raise SystemExit(main())
