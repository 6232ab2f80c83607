"""Real vLLM replicas for tests: a published run of a small model and ``ckptdelta serve --engine vllm``'s
engine behind the replica app, on 127.0.0.1.

Nothing is mocked: vLLM's CPU build starts its own OpenAI server in a child
process (its engine core in another, the worker in the engine core or a process
of its own: ONE_GPU_LAYOUT_ENV), ckptdelta's app forwards to it and hot-loads it.
A start costs 20-35 s on two cores, so a module starts one replica per model and
its tests share it, in the order they are written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from tests.lm import hf_extra_files, rl_step
from tests.replicas import PROMPT, Replica  # noqa: F401 (PROMPT: for the modules that import it from here)

#: vLLM options for the tests' tiny models on a 2-core machine.
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "256", "--dtype", "bfloat16", "--max-num-seqs", "16",
             "--disable-log-stats"]
#: The same with vLLM's own counts on (its ``/metrics``), for the replicas whose tests read them (vllm_generations).
VLLM_ARGS_WITH_STATS = [a for a in VLLM_ARGS if a != "--disable-log-stats"]
#: vLLM with its worker inside the engine-core process (the "uni" executor, vLLM's own default on one GPU;
#: its CPU build starts a worker process of its own unless told this). Each start then spawns two Python
#: processes that import vLLM, not three: 22 s instead of 32 s on two cores. The demo's test keeps the CPU
#: build's default (a worker process), so both layouts stay covered.
ONE_GPU_LAYOUT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def use_one_gpu_layout(mp) -> None:
    """Set ONE_GPU_LAYOUT_ENV through a pytest MonkeyPatch ``mp`` for every vLLM started while it holds."""
    for k, v in ONE_GPU_LAYOUT_ENV.items():
        mp.setenv(k, v)


@pytest.fixture(scope="module")
def one_gpu_layout():
    """For a module whose every vLLM (in process or through the CLI) runs its worker in the engine core:
    ``pytestmark = pytest.mark.usefixtures("one_gpu_layout")`` after importing this fixture."""
    with pytest.MonkeyPatch.context() as mp:
        use_one_gpu_layout(mp)
        yield


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bit_diff(live: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> list[str]:
    """Checkpoint names whose live bits differ from ``truth`` (or are missing): empty when bit-identical."""
    bad = sorted(set(truth) ^ set(live))
    for n in sorted(set(truth) & set(live)):
        a, b = live[n], truth[n]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            bad.append(n)
    return bad


@dataclass
class VllmRun:
    """A run of one model: version v's exact weights are ``truth[v]`` (checkpoint names)."""

    url: str
    model_dir: str
    publisher: object
    truth: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def publish(self, weights: dict[str, torch.Tensor], *, anchor: bool = False) -> int:
        v = max(self.truth) + 1 if self.truth else 0
        r = self.publisher.publish(weights, v, anchor=anchor)
        self.truth[r.version] = {k: t.clone() for k, t in weights.items()}
        return r.version

    def step(self, seed: int) -> int:
        return self.publish(rl_step(self.truth[max(self.truth)], seed=seed))


def publish_vllm_run(url: str, model_dir: str, *, deltas: int = 2) -> VllmRun:
    from ckptdelta.publisher import Publisher
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, f)))
    run = VllmRun(url, model_dir, Publisher(url, extra_files=hf_extra_files(model_dir)))
    run.publish(weights)
    for i in range(deltas):
        run.step(seed=100 + i)
    return run


class VllmReplicaHandle(Replica):
    """tests/replicas.py's :class:`Replica` on a vLLM engine, which can also read back vLLM's live weights."""

    def __init__(self, engine, *, replica_id: str = "vllm-0", api_key: str | None = None):
        super().__init__(engine, replica_id=replica_id, api_key=api_key, timeout=120.0)

    def live_weights(self, tmp_dir: str, *, strict: bool = True) -> dict[str, torch.Tensor]:
        """Every runtime parameter read back by the worker, in checkpoint coordinates.

        ``strict=False`` also reads zeros through a GEMM kernel (as +0.0); ``self.kernel_read`` then names the
        tensors that came through one."""
        out, self.kernel_read = self.read_live(self.engine, tmp_dir, strict=strict, kernel=True)
        return out

    @staticmethod
    def read_live(engine, tmp_dir: str, *, strict: bool = True, kernel: bool = False):
        """:meth:`live_weights` of any vLLM engine; with ``kernel``, also the names read through a GEMM kernel."""
        from safetensors.torch import load_file

        path = os.path.join(tmp_dir, "live.safetensors")
        answer = engine.applier.control.rpc("ckptdelta_read", {"path": path, "strict": strict})[0]
        out = load_file(path)
        os.unlink(path)
        return (out, set(answer.get("kernel_view") or ())) if kernel else out


def vllm_generations(engine) -> tuple[int, int]:
    """(requests vLLM runs now, requests that ran to their end), from vLLM's own ``/metrics`` (a request with
    ``n`` > 1 is ``n`` there; one it aborted is in neither); its vLLM started with VLLM_ARGS_WITH_STATS."""
    running = finished = 0.0
    for line in engine.applier.control.http.get("/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            running += float(line.split()[-1])
        elif line.startswith("vllm:request_success_total") and 'finished_reason="abort"' not in line:
            finished += float(line.split()[-1])
    return int(running), int(finished)


def start_vllm_replica(run: VllmRun, snapshot="latest", *, cache_dir: str | None = None,
                       cache_policy: str = "recompute", replica_id: str = "vllm-0",
                       api_key: str | None = None) -> VllmReplicaHandle:
    from ckptdelta.loader.engines import build_engine

    engine = build_engine("vllm", bucket=run.url, snapshot=snapshot, cache_dir=cache_dir, cache_policy=cache_policy,
                          vllm_args=VLLM_ARGS_WITH_STATS)      # the contract reads vLLM's counts
    return VllmReplicaHandle(engine, replica_id=replica_id, api_key=api_key)
