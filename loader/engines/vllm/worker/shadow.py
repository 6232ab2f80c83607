"""The next version's modules, built beside the live ones while vLLM serves, swapped in during the pause.

Why: on CPU vLLM re-packs every linear layer it loads (oneDNN / sgl handles in
``layer.cpu_linear``), so a reload of whole modules inside the pause costs what
re-packing them costs, whatever the delta's size. Here the same work runs before
the pause, on a *shadow* of the model: a tree of shallow copies of the live
modules (own parameter, buffer and child dicts; everything else shared) that
vLLM's own layerwise reload (``initialize_layerwise_reload`` ->
``model.load_weights`` -> ``finalize_layerwise_reload``) loads into, so names,
fused q/k/v and gate/up groups, tied embeddings and the CPU re-packing follow
vLLM's loaders exactly as in ``reload_weights``. The live modules are never
written while serving:

* a touched module's kernel tensors (what vLLM copies processed values into) are
  fresh placeholders of the live tensors' shapes, not the live tensors;
* every other module of the shadow holds meta placeholders, so a weight that
  loads outside the modules announced would write nowhere (and is refused);
* attention layers are not in the shadow (their deferred post-load step runs on
  the live model only).

The swap, in the pause, does what the tail of vLLM's layerwise reload does for
each touched module: ``copy_`` the processed tensors into the live tensors
(references held by kernels and graphs stay valid) and move over the
attributes processing replaced (``cpu_linear`` and its packed weight). That is
pointer moves plus the bytes of the tensors kernels read as is (norms,
embeddings): the pause no longer re-packs anything.

Runs in the engine worker; :class:`ShadowBuild` does the work in a thread so the
RPC that starts it returns at once and the engine loop keeps generating. Not
covered (the caller falls back to a reload inside the pause): routed experts of
CPU MoE layers (loader/engines/vllm/worker/moe.py), modules the announced paths do
not resolve to, and models whose ``load_weights`` does not report what it
loaded.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
import types
from typing import Any, Callable, Iterable, Mapping

import torch

__all__ = ["ShadowBuild", "ShadowError", "build_shadow", "swap_in"]

#: nn.Module slots the shadow owns (copied); every other attribute is shared until processing replaces it.
_OWN_SLOTS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class ShadowError(RuntimeError):
    """The update cannot be prepared beside the live modules; the caller reloads inside the pause instead."""


def _placeholder(t: torch.Tensor, device: Any) -> torch.Tensor:
    """A tensor of ``t``'s class, attributes, shape, strides and dtype on ``device``, uninitialised."""
    out = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device=device)
    out.__class__ = t.__class__
    out.__dict__ = t.__dict__.copy()
    return out


def _rebind(t: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """Methods carried by ``t``'s attributes (``weight_loader``) bound to ``live`` become bound to ``shadow``."""
    for key, value in list(t.__dict__.items()):
        if isinstance(value, types.MethodType) and value.__self__ is live:
            t.__dict__[key] = value.__func__.__get__(shadow)
    return t


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of one of vLLM's restore-metadata tensors for a shadow module.

    A reload of the live model leaves its metadata tensors' ``weight_loader``
    wrapped in vLLM's ``online_process_loader`` (a closure over the *live* layer's
    reload state). A shadow must get the original loader, or its loads would be
    routed to the live layer's state, dropped as excess, and the shadow would
    keep the old kernels."""
    out = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device="meta")
    out.__class__ = t.__class__
    out.__dict__ = t.__dict__.copy()
    for key in ("weight_loader", "_weight_loader"):   # vLLM's own parameter classes keep it behind a property
        loader = out.__dict__.get(key)
        while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
            loader = getattr(loader, "__wrapped__", None)
            if loader is None:
                raise ShadowError("vLLM's layerwise loader wrapper does not say what it wraps")
            out.__dict__[key] = loader
    return out


class _Tree:
    """The shadow of ``model``: touched subtrees with real placeholders, their ancestors with meta ones."""

    def __init__(self, model: torch.nn.Module, touched: set[str], extra: set[str] = frozenset()):
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

        self._deferred = is_deferred_attention_layer
        self._info, self._info_cls = LAYERWISE_INFO, LayerReloadingInfo
        self.touched = touched | extra
        self.pairs: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []   # (path, live, shadow) to swap
        self.deferred: list[str] = []   # checkpoint tensors the caller leaves to a reload in the pause
        self._memo: dict[int, torch.nn.Module] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        keep = set()
        for path in self.touched:
            parts = path.split(".")
            keep.update(".".join(parts[:i]) for i in range(len(parts)))
        self._keep = keep
        self.root = self._clone(model, "", inside=False)

    def _clone(self, m: torch.nn.Module, path: str, inside: bool) -> torch.nn.Module:
        if id(m) in self._memo:
            return self._memo[id(m)]
        inside = inside or path in self.touched
        s = copy.copy(m)
        self._memo[id(m)] = s
        device = None if inside else "meta"
        s._parameters = {k: None if p is None else self._tensor(p, m, s, device) for k, p in m._parameters.items()}
        s._buffers = {k: None if b is None else self._tensor(b, m, s, device) for k, b in m._buffers.items()}
        s._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
        children = {}
        for k, c in m._modules.items():
            sub = f"{path}.{k}" if path else k
            if c is None or self._deferred(c) or not (inside or sub in self._keep or sub in self.touched):
                continue
            children[k] = self._clone(c, sub, inside)
        s._modules = children
        live_info = self._info.get(m)
        if live_info is not None:
            params, buffers = live_info.restore_metadata
            self._info[s] = self._info_cls(
                restore_metadata=({k: _rebind(_meta_copy(t), m, s) for k, t in params.items()},
                                  {k: _rebind(_meta_copy(t), m, s) for k, t in buffers.items()}),
                restore_device=live_info.restore_device)
        if inside:
            self.pairs.append((path, m, s))
        return s

    def release(self) -> None:
        """Drop everything the shadow holds. Needed, not tidy: vLLM's ``LAYERWISE_INFO`` is a weak-keyed
        dict, but a shadow's entry refers back to its module (the loaders bound to it), so without this every
        shadow, and the packed weights its modules held, would live as long as the worker (seen as a worker
        OOM-killed after a dozen 0.5 GB hot-loads)."""
        for shadow in self._memo.values():
            self._info.pop(shadow, None)
            shadow.__dict__.clear()
        self._memo.clear()
        self._tensors.clear()
        self.pairs = []
        self.root = None  # type: ignore[assignment]

    def _tensor(self, t: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module, device: Any) -> torch.Tensor:
        hit = self._tensors.get(id(t))          # a tensor two modules share (a tied head) stays shared
        if hit is None:
            hit = self._tensors[id(t)] = _rebind(_placeholder(t, device or t.device), live, shadow)
        return hit


class _Quiet(logging.Filter):
    """vLLM warns once per module it reloads nothing into; a shadow's untouched ancestors are those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage() and \
            "were not loaded from checkpoint" not in record.getMessage()


def build_shadow(model: torch.nn.Module, model_config: Any, tensors: Mapping[str, torch.Tensor],
                 modules: Iterable[str], *, extra: Iterable[str] = (),
                 after_load: Callable[[torch.nn.Module], None] | None = None) -> "_Tree":
    """Load ``tensors`` (checkpoint names) into a shadow of ``modules`` (vLLM module paths) of ``model``.

    ``extra``: modules to swap too that load nothing themselves (a tied LM head, which
    ``after_load`` re-packs from the embedding it shares)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO, finalize_layerwise_reload, initialize_layerwise_reload)

    touched = set(modules)
    for path in touched | set(extra):
        try:
            model.get_submodule(path)
        except AttributeError:
            raise ShadowError(f"vLLM module {path!r} does not exist in this model") from None
    tree = _Tree(model, touched, set(extra))
    try:
        locked = []
        for _path, _live, shadow in tree.pairs:       # re-pack under the kernel lock, outside vLLM's steps
            method = shadow.__dict__.get("quant_method")
            if method is not None and hasattr(method, "process_weights_after_loading"):
                shadow.__dict__["quant_method"] = _locked_method(method)
                locked.append((shadow, method))
        quiet = _Quiet()
        loggers = [logging.getLogger("vllm.model_executor.model_loader.reload.layerwise"),
                   logging.getLogger("vllm.model_executor.model_loader.reload.inplace")]
        for lg in loggers:
            lg.addFilter(quiet)
        try:
            with torch.no_grad():
                initialize_layerwise_reload(tree.root)
                loaded = tree.root.load_weights(iter(tensors.items()))
                fused = set(getattr(model, "packed_modules_mapping", None) or {})
                for path, _live, shadow in tree.pairs:
                    # vLLM would process half a fused q/k/v group with uninitialised rows (a padded vocabulary is
                    # also short of its total, legitimately: only fused modules are held to it)
                    info = LAYERWISE_INFO.get(shadow)
                    if path.rpartition(".")[2] in fused and info is not None and info.can_load() \
                            and 0 < info.load_numel < (info.load_numel_total or 0):
                        raise ShadowError(f"vLLM module {path!r} was sent only part of its weights "
                                          f"({info.load_numel} of {info.load_numel_total} elements)")
                finalize_layerwise_reload(tree.root, model_config)
                if after_load is not None:
                    after_load(tree.root)
        finally:
            for lg in loggers:
                lg.removeFilter(quiet)
            for shadow, method in locked:             # the live modules keep their own quant method
                shadow.__dict__["quant_method"] = method
        if loaded is None:
            raise ShadowError(f"{type(model).__name__}.load_weights does not report what it loaded")
        outside = sorted(n for n in loaded if not any(n == p or n.startswith(p + ".") for p in touched))
        if outside:
            raise ShadowError(f"weights loaded outside the announced modules: {outside[:4]}")
        missing = sorted(p for p in touched if not any(n.startswith(p + ".") for n in loaded))
        if missing:
            raise ShadowError(f"modules announced but not loaded: {missing[:4]}")
    except BaseException:
        tree.release()
        raise
    return tree


def swap_in(tree: "_Tree", displaced: list[Any] | None = None) -> int:
    """Make the live modules compute with the shadow's: copy tensors into the live ones, move attributes over.

    Call with the engine paused. Returns the modules swapped. ``displaced`` receives the live attributes
    replaced (the old version's packed kernels): the caller frees them when it likes, out of the pause."""
    _MISSING = object()
    with torch.no_grad():
        for _path, live, shadow in tree.pairs:
            for slot in ("_parameters", "_buffers"):
                mine, theirs = getattr(live, slot), getattr(shadow, slot)
                for name, new in theirs.items():
                    old = mine.get(name)
                    if new is None or old is new:
                        continue
                    if old is not None and old.shape == new.shape and old.dtype == new.dtype \
                            and old.device == new.device:
                        old.data.copy_(new.data)
                    else:
                        mine[name] = _rebind(new, shadow, live)
        for _path, live, shadow in tree.pairs:
            for key, value in shadow.__dict__.items():
                if key in _OWN_SLOTS:
                    continue
                old = live.__dict__.get(key, _MISSING)
                if old is not value:
                    if displaced is not None and old is not _MISSING:
                        displaced.append(old)
                    live.__dict__[key] = value
    return len(tree.pairs)


class FairLock:
    """A lock handed out first come, first served: vLLM's steps and a background job take turns, neither
    starves (a plain Lock lets the engine loop take it back at once, step after step)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._busy = False

    def __enter__(self) -> "FairLock":
        me = object()
        with self._cond:
            self._queue.append(me)
            while self._busy or self._queue[0] is not me:
                self._cond.wait()
            self._queue.popleft()
            self._busy = True
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


#: vLLM's CPU GEMMs (oneDNN ``onednn_mm``) share one process-wide scratchpad, so two threads must never run
#: kernels at once: vLLM's steps and a background job's kernel calls (re-packing, read-back) take this lock.
KERNEL_LOCK = FairLock()
_STEP_METHODS = ("execute_model", "sample_tokens")


def install_step_lock(model_runner: Any) -> None:
    """Make every step of ``model_runner`` (an instance attribute wrapping its own methods) hold
    :data:`KERNEL_LOCK`. Idempotent."""
    hold_kernel_lock(model_runner, _STEP_METHODS, "_ckptdelta_step_lock")


def hold_kernel_lock(obj: Any, names: tuple[str, ...], flag: str) -> None:
    """Wrap each of ``obj``'s methods ``names`` (as instance attributes) so that it holds :data:`KERNEL_LOCK`;
    ``flag``, set on ``obj``, makes it idempotent."""
    hold_lock(obj, names, flag, KERNEL_LOCK)


def hold_lock(obj: Any, names: tuple[str, ...], flag: str, lock: Any) -> None:
    """:func:`hold_kernel_lock` with another lock."""
    if getattr(obj, flag, False):
        return
    for name in names:
        method = getattr(obj, name, None)
        if method is None:
            continue

        def locked(*args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
            with lock:
                return _method(*args, **kwargs)

        setattr(obj, name, locked)
    setattr(obj, flag, True)


def _locked_method(method: Any) -> Any:
    """A copy of a quant method (same class, so vLLM's isinstance checks hold) whose
    ``process_weights_after_loading`` (the CPU re-packing) holds the kernel lock."""
    twin = copy.copy(method)
    inner = method.process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        with KERNEL_LOCK:
            inner(layer)

    twin.process_weights_after_loading = process_weights_after_loading
    return twin


class BackgroundJob:
    """Work run in a thread of the worker (so the RPC that starts it returns at once); ``state`` is
    running, ready or failed. The job's kernel calls hold :data:`KERNEL_LOCK`."""

    def __init__(self, token: str, fn: Callable[[], dict[str, Any]]):
        self.token, self.state, self.error = token, "running", None
        self.result: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"ckptdelta-{token}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], dict[str, Any]]) -> None:
        from ckptdelta.loader.engines.vllm.worker.readback import KERNEL_GUARD

        KERNEL_GUARD.set(lambda: KERNEL_LOCK)
        try:
            self.result = fn()
            self.state = "ready"
        except Exception as e:  # noqa: BLE001 - reported through the worker's answers
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"

    def wait(self, timeout: float | None = None) -> str:
        self._thread.join(timeout)
        return self.state

    def answer(self) -> dict[str, Any]:
        out = {"token": self.token, "state": self.state, **self.result}
        if self.error is not None:
            out["why"] = self.error      # not "error": that key means the RPC itself failed
        return out


class ShadowBuild(BackgroundJob):
    """One shadow built and checked in a background thread; ``tree`` once ready."""

    def __init__(self, token: str, work: Callable[[], "_Tree"], check: Callable[["_Tree"], dict[str, Any]]):
        self.tree: _Tree | None = None

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            tree = work()
            t1 = time.perf_counter()
            try:
                facts = {"build_s": t1 - t0, "modules": len(tree.pairs), **check(tree),
                         "check_s": time.perf_counter() - t1}
            except BaseException:
                tree.release()
                raise
            self.tree = tree
            return facts

        super().__init__(token, run)

    def release(self) -> None:
        """Drop the shadow (after it was swapped in, or when it will not be)."""
        tree, self.tree = self.tree, None
        if tree is not None:
            tree.release()
