"""The swap into vLLM (steps 2-6 of loader/engines/vllm/replica.py's docstring): which modules to
rebuild (whole fused groups), the shadow built beside the live ones while vLLM serves, the pause, the
proof of what the pause wrote, the rollback when it fails.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence


from ckptdelta.delta.errors import HotLoadError

from ckptdelta.loader import stopping
from ckptdelta.loader.engines.base import EngineApplier
from ckptdelta.loader.engines.shared_weights import SharedWeights, write_positions
from ckptdelta.loader.engines.vllm.tp import sliced, uncovered
from ckptdelta.loader.engines.vllm.control import CONTROL_TIMEOUT_S, VllmControl, VllmError

log = logging.getLogger("ckptdelta.engine.vllm")
#: Input columns of each kernel-read matrix the in-pause check reads under --verify sampled (random each swap).
SAMPLED_COLUMNS = 16
VERIFY_MODES = ("sampled", "full", "off")


# --- fused groups ---------------------------------------------------------------------------------

def module_key(name: str, member_of: dict[str, str]) -> str:
    """The vLLM module a checkpoint tensor loads into (``...q_proj.weight`` -> ``...qkv_proj``; every expert
    tensor of a layer -> its ``...experts``); ``member_of`` maps a fused member's leaf to the fused leaf."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    if ".experts." in module + ".":
        return module.split(".experts.")[0] + ".experts"
    leaf = member_of.get(leaf, leaf)
    return f"{parent}.{leaf}" if parent else leaf


def members_of(packed: dict[str, list[str]]) -> dict[str, str]:
    return {m: fused for fused, members in packed.items() for m in members}


def reload_groups(names: Sequence[str], all_names: Sequence[str], packed: dict[str, list[str]]) -> list[str]:
    """``names`` grown to whole vLLM modules: every checkpoint tensor that loads into a module one of them
    loads into (q/k/v -> qkv_proj, gate/up -> gate_up_proj, weight with bias, all experts of a layer).

    vLLM re-processes a module once all of its parameters arrived; a module fed
    only part of its inputs is processed with uninitialised rows."""
    member_of = members_of(packed)
    wanted = {module_key(n, member_of) for n in names}
    return [n for n in all_names if module_key(n, member_of) in wanted]


# --- the swap -------------------------------------------------------------------------------------

@dataclass
class _Shadow:
    """The next version's modules, built in every worker while serving (loader/engines/vllm/worker/shadow.py)."""

    token: str
    reload: tuple[str, ...] = ()   # of its tensors, those the pause still reloads (CPU MoE experts)
    facts: dict[str, Any] = field(default_factory=dict)


class VllmApplier(EngineApplier):
    """Pauses vLLM around a commit and pushes the changed tensors of the host copy into its workers."""

    def __init__(self, control: VllmControl, shared: SharedWeights, *, cache_policy: str, packed: dict[str, list[str]],
                 verify: str = "sampled", patchable: Sequence[str] = (), apply_mode: str = "auto"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify {verify!r}: expected one of {VERIFY_MODES}")
        self.control, self.shared, self.cache_policy, self.packed, self.verify = (
            control, shared, cache_policy, packed, verify)
        # tensors whose runtime parameter a kernel reads as is: their changed elements are written in place
        self.patchable = set(patchable) if apply_mode == "auto" else set()
        # modules re-packed beside the live ones while serving (before the pause), swapped in during it
        self.shadows = apply_mode == "auto"
        self.epoch = 0                       # pauses begun (loader/engines/vllm/watch.py reads it)
        self.swapping = False
        self.last: dict[str, Any] = {}
        self.current_version: Any = lambda: None  # the swapper's version (set by build); labels vLLM after a swap
        self.on_unverified: Any = lambda: None    # called when live weights stay unproven (build: version -> None)
        self._to_confirm: list[str] = []
        self._pause: Any = None              # the commit's, while paused() runs
        self._unreached = self._applied = False

    @contextmanager
    def paused(self) -> Iterator[Any]:
        """The swapper's commit. vLLM computes with its own tensors, not the host copy, so it serves on while
        the swapper writes the host copy; :meth:`apply` stops it (keep mode) just before it touches a worker,
        and leaving this resumes it: the pause is the engine-side work alone."""
        from ckptdelta.loader.gate import Pause

        self._pause, self._unreached, self._applied = Pause(), False, False
        self._to_confirm: list[str] = []
        try:
            yield self._pause
        finally:
            if self._pause.started:
                self._resume()
        if self._to_confirm:
            self._confirm(self._to_confirm)

    def _stop(self) -> None:
        """Pause vLLM (once per commit): running steps end, requests in flight freeze, nothing is aborted."""
        if self._pause is None:
            raise HotLoadError("VllmApplier.apply called outside paused()")
        if self._pause.started:
            return
        t0 = self._pause.started = time.perf_counter()
        self.swapping = True
        self.epoch += 1
        try:
            self.control.pause()
        except VllmError:
            self._unreached = True    # nothing reached the workers: the host copy's rollback is all to undo
            raise
        self._pause.waited_s = time.perf_counter() - t0

    def _resume(self) -> None:
        """End the pause: drop the prefix cache, label the version, resume. vLLM is resumed whatever failed
        before. A failure makes the version unknown and the hot-load fail: the new bits are in, but KV the old
        ones computed may stay in frozen requests, or vLLM's label is wrong, so no version can be claimed; the
        next hot-load pushes and proves every tensor (:meth:`apply`)."""
        t0 = self._pause.started
        failed: list[str] = []
        stopping.hold("resume")
        try:
            try:
                ok = self.control.reset_prefix_cache(running=self.cache_policy == "recompute")
                if not ok:
                    log.warning("vLLM did not reset its prefix cache (blocks held by frozen requests under the "
                                "'keep' policy); per-version cache salts keep new requests off the old prefixes")
            except VllmError as e:
                failed.append(f"resetting its prefix cache: {e}")
                self.on_unverified()
            try:
                self.control.set_version(self.current_version())
            except VllmError as e:
                failed.append(f"labelling its weight version: {e}")
                self.on_unverified()
        finally:
            try:
                self._resume_engine()
            except VllmError as e:
                failed.append(f"resuming: {e}")
                self.on_unverified()
            self.swapping = False
            self._pause.seconds = time.perf_counter() - t0
        if failed:
            self._to_confirm = []
            raise HotLoadError(f"vLLM at {self.control.url} failed while ending the pause ({'; '.join(failed)}); "
                               "the replica's version is now unknown: the next hot-load pushes and proves every "
                               "tensor")

    def _resume_engine(self, tries: int = 3) -> None:
        """``/resume``, tried again on failure: a vLLM left paused freezes every request."""
        for i in range(tries):
            try:
                self.control.resume()
                return
            except VllmError as e:
                log.error("vLLM at %s did not resume (try %d of %d): %s", self.control.url, i + 1, tries, e)
                if i + 1 == tries:
                    raise
                time.sleep(0.2 * (i + 1))

    def _plan(self, names: Sequence[str], positions: dict[str, Any]) -> tuple[list[str], list[str]]:
        """(tensors to push as whole vLLM modules, tensors to patch element-wise in place)."""
        sparse = {n for n in names if n in self.patchable and positions.get(n) is not None}
        groups = reload_groups([n for n in names if n not in sparse], list(self.shared.index), self.packed)
        return groups, sorted(sparse - set(groups))   # a tensor reloaded with its module needs no patch

    def _build(self, groups: list[str], version: int | None) -> _Shadow | None:
        """While vLLM serves, the host copy already holding ``version``: have every worker build the modules
        of ``groups`` beside the live ones, re-packed, and check them by samples against the host copy. None
        when that fails (logged, never raised: the pause then reloads them; a shadow only saves pause time)."""
        t0 = time.perf_counter()
        token = f"{version}-{uuid.uuid4().hex[:12]}"
        member_of = members_of(self.packed)
        try:
            self.control.rpc("ckptdelta_stage", {
                "path": self.shared.path, "names": groups, "token": token, "columns": SAMPLED_COLUMNS,
                "modules": sorted({module_key(n, member_of) for n in groups})})
            answers = self._staged(token)
            why = sorted({str(a.get("why") or a.get("state")) for a in answers if a.get("state") != "ready"})
        except (VllmError, OSError, RuntimeError, ValueError) as e:
            why = [str(e)]
        if why:
            log.warning("vLLM: could not build %s beside the live weights (%s); the pause reloads them instead",
                        snapshot_label(version), "; ".join(why))
            self._drop(token)
            return None
        facts = {"stage_s": time.perf_counter() - t0, "build_s": max(a.get("build_s", 0.0) for a in answers),
                 "check_s": max(a.get("check_s", 0.0) for a in answers), "modules": answers[0].get("modules")}
        log.info("vLLM: %s built beside the live weights: %d tensors in %s modules, %.2fs",
                 snapshot_label(version), len(groups), facts["modules"], facts["stage_s"])
        return _Shadow(token, tuple(answers[0].get("deferred") or ()), facts)

    def _staged(self, token: str) -> list[dict[str, Any]]:
        return self._poll("ckptdelta_staged", token, "building the shadow")

    def _poll(self, method: str, token: str, what: str, timeout: float = CONTROL_TIMEOUT_S) -> list[dict[str, Any]]:
        return self.control.poll(method, token, what, timeout)

    def _drop(self, token: str) -> None:
        try:
            self.control.rpc("ckptdelta_unstage", {"token": token})
        except VllmError as e:
            log.debug("vLLM: dropping shadow %s: %s", token, e)

    def apply(self, names: Sequence[str], version: int | None, positions: dict[str, Any] | None = None) -> None:
        """Push ``names`` into every worker from the host copy, then prove them: the changed elements of
        tensors with an in-place target (loader/engines/vllm/worker/patch.py); the rest as whole modules, built and
        re-packed beside the live ones while vLLM still serves, then swapped in; else reloaded in the pause."""
        positions = positions or {}
        # The version is unknown (a failed swap or proof left vLLM's bits unproven): what vLLM holds may differ
        # from the host copy anywhere, whatever the update changed in it. Everything is pushed and proven.
        recovering = self.current_version() is None
        if recovering:
            names, positions = list(self.shared.index), {}
        groups, patch = self._plan(names, positions)
        again, self._applied = self._applied, True
        if again and (self._unreached or not self._pause.started):
            return                    # putting the old version back, but nothing reached the workers
        self._to_confirm = []
        # not once paused: putting the old version back after a failed swap reloads it in that pause
        shadow = self._build(groups, version) if (groups and self.shadows and not self._pause.started
                                                  and not recovering) else None
        swapped = False
        try:    # a shadow not swapped in is dropped however this ends (positions unwritable, the pause refused...)
            patch_req = None
            if patch:
                spans = write_positions(self.shared.positions_path, ((n, positions[n]) for n in patch))
                # the worker reads the written positions back at once (the rest of each tensor was not touched)
                patch_req = {"path": self.shared.path, "positions": self.shared.positions_path, "spans": spans,
                             "check": self.verify != "off"}
            self._stop()
            stopping.hold("pause")
            t_stopped = time.perf_counter()
            if shadow is not None:
                # one round trip: the shadow swapped in, then the in-place patches
                self.control.rpc("ckptdelta_swap", {"token": shadow.token, "patch": patch_req})
                swapped, patch_req = True, None
                if shadow.reload:
                    self.control.rpc("ckptdelta_reload", {"path": self.shared.path, "names": list(shadow.reload)})
            elif groups:
                self.control.rpc("ckptdelta_reload", {"path": self.shared.path, "names": groups})
        finally:
            if shadow is not None and not swapped:
                self._drop(shadow.token)
        if patch_req is not None:
            self.control.rpc("ckptdelta_patch", patch_req)
        t1 = time.perf_counter()
        touched = sorted(set(groups) | set(patch) | set(names))   # what was sent, and every tensor that changed
        # sampled here: every changed tensor but the patched ones (read back as written) and a swapped-in
        # shadow's (sampled before the pause)
        shadowed = set(groups) - set(shadow.reload) if shadow is not None else set()
        in_pause = sorted(set(touched) - set(patch) - shadowed)
        verified = 0
        stopping.hold("proof")
        full = self.verify == "full" or (recovering and self.verify != "off")
        if full:
            verified = self.check(touched)            # raises unless every digest matched
        elif self.verify == "sampled" and in_pause:
            verified = self.check_sampled(in_pause)   # raises at the first difference it sees
        # /v1/status's engine.last_swap: the replica's own word on the weights it pushed for ``version``
        mode = ("shadow+reload" if shadow.reload else "shadow") if swapped else "reload" if groups else "patch"
        self.last = {"version": version, "apply": mode, "reloaded_tensors": len(groups),
                     "patched_tensors": len(patch), "patched_elements": int(sum(len(positions[n]) for n in patch)),
                     "stop_s": self._pause.waited_s, "reload_s": t1 - t_stopped,
                     "verify_s": time.perf_counter() - t1, "verify": self.verify, "recovered": recovering,
                     "verified": full, "verified_tensors": verified if full else 0}
        if swapped:
            self.last["shadow"] = shadow.facts
        if self.verify == "sampled" and not full:
            self._to_confirm = touched

    def check_sampled(self, names: Sequence[str]) -> int:
        """The cheap proof for inside the pause: plain tensors bit for bit, ``SAMPLED_COLUMNS`` random input
        columns of every matrix read through a GEMM kernel; compared with the host copy in each worker."""
        for w, answer in enumerate(self.control.rpc("ckptdelta_check", {"path": self.shared.path, "names": list(names),
                                                                        "columns": SAMPLED_COLUMNS})):
            bad = answer.get("mismatch") or []
            if bad:
                raise HotLoadError(f"vLLM worker {w}: live weights differ from the snapshot for {len(bad)} "
                                   f"tensors ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        return len(names)

    def _confirm(self, names: list[str]) -> None:
        """After resuming: the full proof of what the pause checked by samples. A difference the samples missed
        is pushed again (whole modules) and checked again; if it stays, the version becomes unknown."""
        t0 = time.perf_counter()
        try:
            self.last["verified_tensors"] = self.check(names, background=True)
        except (HotLoadError, VllmError) as first:
            log.critical("vLLM's live weights differ from the host copy after resuming (%s); reloading them in "
                         "a pause of their own", first)
            try:
                self.last["verified_tensors"] = self._repair(names)
            except (HotLoadError, VllmError) as second:
                self.on_unverified()
                self._label_unknown()
                self.last.update(verified=False, verify_after_s=time.perf_counter() - t0)
                raise HotLoadError(f"vLLM's live weights could not be proven after the swap ({second}); the "
                                   "replica's version is now unknown: the next hot-load pushes and proves every "
                                   "tensor") from second
        self.last.update(verified=True, verify_after_s=time.perf_counter() - t0)

    def _repair(self, names: list[str]) -> int:
        """Push ``names`` again as whole modules inside a pause, prove them in full there, and drop every
        prefix (running requests' included): whatever ran since resuming computed its KV with wrong bits, and
        it must not stay cached under this version's salt."""
        self.swapping = True
        self.epoch += 1
        try:
            self.control.pause()
            try:
                self.control.rpc("ckptdelta_reload", {"path": self.shared.path,
                                                      "names": reload_groups(names, list(self.shared.index),
                                                                             self.packed)})
                n = self.check(names)
                if not self.control.reset_prefix_cache(running=True):
                    raise VllmError(f"vLLM at {self.control.url} did not reset its prefix cache after the repair")
                return n
            finally:
                self._resume_engine()
        finally:
            self.swapping = False

    def _label_unknown(self) -> None:
        try:
            self.control.set_version(None)
        except VllmError as e:
            log.warning("vLLM at %s: could not label its weights unknown: %s", self.control.url, e)

    def check(self, names: Sequence[str] | None = None, *, background: bool = False) -> int:
        """Compare the live weights (read back in checkpoint coordinates by every worker) with the host copy.

        ``background``: read them back in the workers' threads, taking turns with vLLM's steps, instead of
        inside one RPC that holds vLLM's engine loop (for the proof after resuming, while serving)."""
        names = list(self.shared.index) if names is None else list(names)
        if background:
            token = f"digests-{uuid.uuid4().hex[:12]}"
            self.control.rpc("ckptdelta_digests_start", {"names": names, "token": token})
            answers = self._poll("ckptdelta_job", token, "reading the live weights back")
            failed = [a.get("why") or a.get("state") for a in answers if a.get("state") != "ready"]
            if failed:
                raise VllmError(f"vLLM at {self.control.url}: reading the live weights back failed: {failed[0]}")
        else:
            answers = self.control.rpc("ckptdelta_digests", {"names": names})
        # tensor parallelism: each worker hashed the slices it holds (loader/engines/vllm/tp.py); together
        # they must cover every element, and each is compared with the same slice of the host copy
        parts = [answer.get("slices") or {} for answer in answers]
        gaps = uncovered({n: tuple(self.shared.tensors[n].shape) for n in names}, parts)
        if gaps:
            raise HotLoadError(f"vLLM's {len(answers)} workers read back slices that do not cover {len(gaps)} "
                               f"tensors whole ({', '.join(gaps[:4])}{', ...' if len(gaps) > 4 else ''}): "
                               "their tensor-parallel layout is not one loader/engines/vllm/tp.py knows")
        for w, answer in enumerate(answers):
            got = answer.get("digests") or {}
            expected = expected_digests(self.shared, names, set(answer.get("kernel_view") or ()), parts[w])
            bad = sorted(n for n in names if got.get(n) != expected[n])
            if bad:
                raise HotLoadError(f"vLLM worker {w}: live weights differ from the snapshot for {len(bad)} "
                                   f"tensors ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        return len(names)


def expected_digests(shared: SharedWeights, names: Sequence[str], kernel: set[str] = frozenset(),
                     slices: dict[str, Any] | None = None) -> dict[str, str]:
    """xxh3 of each host-copy tensor as the worker's read-back reports it: its bits, or for a tensor the worker
    read through a GEMM kernel, its :func:`ckptdelta.loader.engines.vllm.proof.kernel_view`; under tensor parallelism,
    of the slice the worker holds (``slices``: name -> [dim, start, length], loader/engines/vllm/tp.py)."""
    from ckptdelta.loader.engines.vllm.proof import digests, kernel_view

    held = sliced(shared.tensors, names, slices)
    return digests({n: kernel_view(held[n]) if n in kernel else held[n] for n in names})


def snapshot_label(version: int | None) -> str | None:
    from ckptdelta.delta.manifest import snapshot_name

    return None if version is None else snapshot_name(version)
