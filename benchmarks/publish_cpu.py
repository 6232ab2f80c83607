"""Where a LoRA publish's CPU goes, thread by thread, through a real S3 API.

On the 2 cores of ``benchmarks.lora`` the trainer's process shares the CPU with vLLM, so
every millisecond of CPU a publish spends comes back as one or more of wall time. This
measures that CPU by thread on a quiet machine: a peft LoRA adapter on the same
Llama-shaped base as ``benchmarks.lora`` (published as ``--dtype``), trained by AdamW
on real gradients, published after each step into an rclone ``serve s3`` bucket on
127.0.0.1 (unshaped). Around each ``publish()`` call the CPU time of each thread of the
process is read from ``/proc/self/task/*/schedstat`` and summed by role: the publish thread (the
encode's glue and its share of the chunks, the part files, the commit), the codec
threads (their share of the chunks), the S3 client (fsspec's event-loop thread, where
s3fs and aiobotocore build, sign and send every request), the upload threads (each waits
for its request there), the caller (the host copy) and the rest (threads that ended
within the call included: the process's CPU time less the roles'). Medians over
``--publishes`` steps per rank, after the anchor and one delta, of the deltas (a periodic
anchor among them is left out); parts per delta from each manifest (docs/FORMAT.md: a
request each, plus the manifest's and HEAD's).

    python -m benchmarks.publish_cpu [--ranks 16,64] [--dtype bf16] [--publishes 12]

Writes benchmarks/results/publish_cpu{,-fp32}{,-quick}.{md,json,png}.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks import harness

#: Thread-name prefixes of each role (the publisher's pools name their threads; fsspec names its loop's).
ROLES = (("publish thread", "ckptdelta-publish"), ("codec threads", "ckptdelta-codec"),
         ("S3 client (fsspec loop)", "fsspecIO"), ("upload threads", "ckptdelta-upload"), ("caller", "MainThread"))


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by role (threads of no role under "other")."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:        # schedstat's first field: nanoseconds on a CPU (stat's utime and stime count 10 ms ticks)
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
        except (OSError, TypeError, ValueError, IndexError):
            continue                        # ended meanwhile: its CPU shows in the process's, under "other"
        role = next((r for r, prefix in ROLES if t.name.startswith(prefix)), "other")
        out[role] = out.get(role, 0.0) + cpu
    return out


def measure_rank(base_dir: str, url: str, opts: dict, scratch: str, rank: int, lr: float, dtype: str,
                 publishes: int, warmup: int, batch: list[int]) -> dict[str, Any]:
    """Per-publish wall and CPU (by role) of ``publishes`` delta steps at ``rank``."""
    from benchmarks.lora_peers import Trainer
    from ckptdelta.delta.manifest import manifest_key

    t = Trainer(url, opts, scratch)
    t.op_init(base_dir, rank, f"r{rank}", warmup, lr, dtype, batch)
    samples = []
    try:
        for i in range(publishes + 1):
            t.op_train(lr)
            before, c0, w0 = thread_cpu(), time.process_time(), time.perf_counter()
            r = t.pub.publish(t.model, t.steps)
            wall, cpu, after = time.perf_counter() - w0, time.process_time() - c0, thread_cpu()
            if i == 0 or r.kind != "delta":
                continue                    # the first delta (the codec's first choice, buffers first used), anchors
            roles = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in {*before, *after}}
            roles["other"] = cpu - sum(v for k, v in roles.items() if k != "other")
            manifest = json.loads(t.fs.cat_file(f"{t.root}/r{rank}/ckptdelta/{manifest_key(r.version)}"))
            samples.append({"wall_s": wall, "cpu_s": cpu, "roles": roles, "parts": len(manifest["objects"]),
                            "stored_bytes": r.stored_bytes, "encode_s": r.encode_s, "copy_s": r.copy_s,
                            "kind": r.kind, "codec": r.codec})
            print(f"  r{rank} v{r.version}: wall {harness.ms(wall)}, CPU {harness.ms(cpu)}, "
                  f"{len(manifest['objects'])} parts, {harness.mb(r.stored_bytes)} MB", flush=True)
    finally:
        t.op_close()
    roles = [k for k in [r for r, _ in ROLES] + ["other"] if any(k in s["roles"] for s in samples)]
    return {"rank": rank, "samples": samples,
            "wall_s": statistics.median(s["wall_s"] for s in samples),
            "cpu_s": statistics.median(s["cpu_s"] for s in samples),
            "roles": {k: statistics.median(s["roles"].get(k, 0.0) for s in samples) for k in roles},
            "parts": statistics.median(s["parts"] for s in samples),
            "stored_bytes": statistics.median(s["stored_bytes"] for s in samples)}


def markdown(out: dict[str, Any]) -> str:
    rows = out["rows"]
    roles = [r for r, _ in ROLES] + ["other"]
    head = ["rank", "MB / delta", "parts", "wall", "**CPU**", *roles]
    lines = [f"# Where a LoRA publish's CPU goes ({out['meta']['dtype']} adapters)", "",
             f"`{out['meta']['command']}`. {out['meta']['machine']}. {out['meta']['setup']}", "",
             "Medians per publish (ms); the roles add up to the CPU column (each its own median, so nearly):", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([str(r["rank"]), harness.mb(r["stored_bytes"]), f"{r['parts']:g}",
                                        harness.ms(r["wall_s"]), f"**{harness.ms(r['cpu_s'])}**",
                                        *(harness.ms(r["roles"].get(k, 0.0)) for k in roles)]) + " |")
    lines += ["", "Publish thread: the encode's glue and its share of the chunks, the part files, the commit. "
              "Codec threads: their share of the chunks. S3 client: fsspec's event-loop thread, where s3fs and "
              "aiobotocore build, sign (SigV4 hashes the payload over plain HTTP) and send each request, a "
              "request per part plus the manifest's and HEAD's. Upload threads: each waits there for its "
              "request. Caller: the host copy. Other: the process's CPU time less the roles' (threads that ended "
              "within the call; two clocks, so it may read a little below 0).", ""]
    return "\n".join(lines)


def plot(out: dict[str, Any], path: str) -> None:
    roles = [r for r, _ in ROLES] + ["other"]
    with harness.figure(path, figsize=(7, 3.5)) as (fig, ax):
        left = [0.0] * len(out["rows"])
        labels = [f"rank {r['rank']}" for r in out["rows"]]
        for k in roles:
            v = [max(0.0, 1e3 * r["roles"].get(k, 0.0)) for r in out["rows"]]     # "other" may read below 0
            ax.barh(labels, v, left=left, label=k)
            left = [a + b for a, b in zip(left, v)]
        ax.set_xlabel("CPU per publish (ms, medians)")
        ax.set_title(f"A LoRA publish's CPU by thread ({out['meta']['dtype']}, S3 API on 127.0.0.1)")
        ax.legend(fontsize=7, loc="lower right")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("publish_cpu", __doc__, quick="tiny base, rank 16, 3 publishes: a smoke test")
    p.add_argument("--ranks", default="16,64", help="LoRA ranks, comma-separated (default 16,64)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate (default 1e-4)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16",
                   help="the adapter as published: cast to bf16 (default) or as peft trains it (fp32)")
    p.add_argument("--publishes", type=int, default=12, help="timed delta publishes per rank (default 12)")
    p.add_argument("--warmup", type=int, default=10, help="AdamW steps before the anchor (default 10)")
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    from benchmarks import s3disk
    from benchmarks.lora import FULL, QUICK, save_base

    shape, ranks, batch = (QUICK, [16], [2, 16]) if a.quick else (FULL, [int(x) for x in a.ranks.split(",")], [2, 64])
    if a.quick:
        a.publishes, a.warmup = 3, 2
    import torch

    torch.set_num_threads(1)            # as benchmarks.lora's trainer (--trainer-threads 1)
    with tempfile.TemporaryDirectory(prefix="ckptdelta-publish-cpu-") as scratch:
        base_dir, _ = save_base(os.path.join(scratch, "base"), shape)
        server = s3disk.start(None, None, os.path.join(scratch, "bucket"))
        try:
            rows = [measure_rank(base_dir, server.url, server.options, os.path.join(scratch, f"t{r}"), r, a.lr,
                                 a.dtype, a.publishes, a.warmup, batch)
                    for r in ranks]
        finally:
            server.proc.kill()
            server.proc.wait()
    out = {"meta": {"command": harness.command("publish_cpu", argv), "dtype": a.dtype, "lr": a.lr,
                    "machine": harness.machine(),
                    "setup": f"Base {shape}, peft LoRA on every linear layer, AdamW lr {a.lr:g} on a "
                             f"{batch[0]}x{batch[1]} token batch per step, 1 torch thread; bucket: rclone serve s3 "
                             f"({s3disk.RCLONE_PIN}) over a directory on 127.0.0.1, unshaped; {a.publishes} timed "
                             f"publishes per rank after the anchor and one delta; python {platform.python_version()}."},
           "rows": rows}
    name = "publish_cpu" + ("-fp32" if a.dtype == "fp32" else "") + ("-quick" if a.quick else "")
    harness.write(os.path.join(a.out_dir, name), markdown(out), out, lambda path: plot(out, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
