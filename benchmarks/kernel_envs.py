"""Two environments on one machine, one kernel cache: what a trainer's first publish and a replica's first
hot-load cost when each runs in a fresh process, alternating between an environment with this project's numba
and one with another numba and llvmlite (a TRL trainer's pins beside vLLM's).

Each run of the workload is a fresh interpreter that publishes an anchor and one bf16 delta of 8 x 1M elements
(1% changed) to a local run and hot-loads the delta into a host copy of the anchor: the delta's publish() and
the hot-load both compile the codec's kernels when the cache has none for that environment. Three layouts of
the cache, each from empty:

- ``shared``: one numba cache folder for both environments (``NUMBA_CACHE_DIR``), as the cache beside the
  sources was before kernels were kept per environment: each environment's index files replace the other's.
- ``per environment``: the project's kernel cache (delta/kernel_cache.py) under one root, a folder per
  Python, numba, llvmlite and CPU.
- ``warmed``: the same, after ``ckptdelta warmup`` ran in each environment (a trainer image's build step).

The other environment is this interpreter with another numba and llvmlite first on ``PYTHONPATH`` (installed
with pip into a folder of the run's), so everything else is the same.

    python -m benchmarks.kernel_envs                       # numba 0.68.1 / llvmlite 0.50.0 beside ours (~10 min)
    python -m benchmarks.kernel_envs --rounds 1            # A, B once per layout

Writes benchmarks/results/kernel_envs.{md,json,png}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import harness

WORKLOAD = r'''
import json, os, sys, time
t_start = time.perf_counter()
import torch
from ckptdelta import Publisher, SnapshotReader
from ckptdelta.loader.hotswap import HotSwapper
import numba
url = sys.argv[1]
g = torch.Generator().manual_seed(0)
w = {f"layer{i}.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(8)}
new = {}
for n, t in w.items():
    t = t.clone()
    flat = t.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 100]
    flat[idx] = (flat[idx].float() * 1.01).to(torch.bfloat16)
    new[n] = t
with Publisher(url, progress=False) as pub:
    pub.publish(w, 0)
    t0 = time.perf_counter()
    pub.publish(new, 1)
    publish_s = time.perf_counter() - t0
reader = SnapshotReader(url)
live = {n: t.clone() for n, t in w.items()}
t0 = time.perf_counter()
HotSwapper(live, reader, version=0).hotload(1)
hotload_s = time.perf_counter() - t0
assert all(torch.equal(live[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
print(json.dumps({"numba": numba.__version__, "publish_s": publish_s, "hotload_s": hotload_s,
                  "process_s": time.perf_counter() - t_start}))
'''


def other_env(folder: str, numba: str, llvmlite: str) -> str:
    """A folder holding the other numba and llvmlite, first on PYTHONPATH for the other environment."""
    site = os.path.join(folder, "site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--target", site, f"numba=={numba}", f"llvmlite=={llvmlite}"], check=True)
    return site


def run_workload(env: dict[str, str], tmp: str, label: str) -> dict[str, Any]:
    url = tempfile.mkdtemp(prefix="run-", dir=tmp)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", WORKLOAD, url], env=env, capture_output=True, text=True,
                       cwd=harness.REPO, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"workload in {label} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def environments(base: dict[str, str], other_site: str) -> dict[str, dict[str, str]]:
    ours = dict(base)
    theirs = dict(base, PYTHONPATH=os.pathsep.join(p for p in (other_site, base.get("PYTHONPATH")) if p))
    return {"A (ours)": ours, "B (other numba)": theirs}


def measure(rounds: int, numba: str, llvmlite: str, warmups: dict[str, float]) -> list[dict[str, Any]]:
    """The workload's rows, in the order run; ``warmups`` gets each environment's ``ckptdelta warmup`` seconds."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kernel-envs-") as tmp:
        site = other_env(tmp, numba, llvmlite)
        base = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "CKPTDELTA_KERNEL_CACHE")}
        base["CKPTDELTA_WARMUP"] = "0"      # the hot-load's background warm-up would hide nothing but blur
        for layout in ("shared", "per environment", "warmed"):
            cache = tempfile.mkdtemp(prefix="cache-", dir=tmp)
            env0 = dict(base, **({"NUMBA_CACHE_DIR": cache} if layout == "shared" else
                                 {"CKPTDELTA_KERNEL_CACHE": cache}))
            envs = environments(env0, site)
            if layout == "warmed":
                for label, env in envs.items():
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "ckptdelta", "warmup", "--no-progress"], env=env,
                                   cwd=harness.REPO, check=True, capture_output=True, timeout=3600)
                    warmups[label] = time.perf_counter() - t0
                    print(f"  warmup in {label}: {warmups[label]:.1f}s", flush=True)
            for rnd in range(rounds):
                for label, env in envs.items():
                    r = run_workload(env, tmp, label)
                    r.update(layout=layout, env=label, round=rnd + 1)
                    rows.append(r)
                    print(f"  {layout:16s} {label:16s} round {rnd + 1}: publish {r['publish_s']:.2f}s, "
                          f"hot-load {r['hotload_s']:.2f}s (numba {r['numba']})", flush=True)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Two environments, one kernel cache ({meta['date']})", "",
             harness.machine(f"environment A: numba {meta['numba_a']}; B: numba {meta['numba_b']}, llvmlite "
                             f"{meta['llvmlite_b']}"), "",
             f"`{meta['command']}`: each row a fresh process, in the order run; publish() of one bf16 delta "
             "(8 x 1M elements, 1% changed) and its hot-load, each including any kernel compile.", "",
             "| cache | environment | round | first delta publish() (s) | first hot-load (s) |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['env']} | {r['round']} | {r['publish_s']:.2f} | {r['hotload_s']:.2f} |")
    if meta.get("warmup_s"):
        lines += ["", "`ckptdelta warmup` (every kernel, both codecs, every dtype): " + ", ".join(
            f"{k} {v:.0f} s" for k, v in meta["warmup_s"].items()) + "."]
    later = [r for r in rows if r["round"] > 1 or r["layout"] == "warmed"]
    lines += ["", "After the first round (every environment has run once):", "",
              "| cache | median publish() (s) | median hot-load (s) |", "|---|---:|---:|"]
    for layout in ("shared", "per environment", "warmed"):
        rs = [r for r in later if r["layout"] == layout]
        if rs:
            m = harness.medians(rs, ["publish_s", "hotload_s"])
            lines.append(f"| {layout} | {m['publish_s']:.2f} | {m['hotload_s']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]]):
    def draw(path: str) -> None:
        with harness.figure(path, figsize=(9, 4)) as (fig, ax):
            labels = [f"{r['layout']}\n{r['env'].split()[0]}{r['round']}" for r in rows]
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [r["publish_s"] for r in rows], width=0.4, label="first delta publish()")
            ax.bar([x + 0.2 for x in xs], [r["hotload_s"] for r in rows], width=0.4, label="first hot-load")
            ax.set_xticks(list(xs), labels, fontsize=6)
            ax.set_ylabel("seconds (fresh process)")
            ax.set_title("Alternating two environments: shared cache vs per environment vs warmed")
            ax.legend()
    return draw


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = harness.parser("kernel_envs", __doc__, from_json="re-render an earlier run's JSON")
    p.add_argument("--rounds", type=int, default=2, help="A, B alternations per cache layout (default 2)")
    p.add_argument("--other-numba", default="0.68.1", help="environment B's numba (default 0.68.1, TRL's pin)")
    p.add_argument("--other-llvmlite", default="0.50.0", help="environment B's llvmlite (default 0.50.0)")
    a = p.parse_args(argv)
    if a.from_json:
        data = harness.read_json(a.from_json)
        rows, meta = data["rows"], data["meta"]
    else:
        import numba

        warmups: dict[str, float] = {}
        rows = measure(a.rounds, a.other_numba, a.other_llvmlite, warmups)
        meta = {"warmup_s": warmups, "date": time.strftime("%Y-%m-%d"), "command": harness.command("kernel_envs", argv),
                "numba_a": numba.__version__, "numba_b": a.other_numba, "llvmlite_b": a.other_llvmlite}
    harness.write(os.path.join(a.out_dir, "kernel_envs"), markdown(rows, meta), {"meta": meta, "rows": rows},
                  plot(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
