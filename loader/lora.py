"""LoRA runs on the replica side, whatever the engine: which base to load, and what a replica refuses.

A LoRA run's snapshots are adapters (delta/lora_record.py): a replica serves one on the
exact base it was trained on, so before it serves it loads the base (``--base-model DIR``,
or the directory the run's record names), hashes its weights as the publisher did and
refuses, in one line naming both, a base whose digest differs. A hot-load is refused
the same way when its target records another base, or another adapter config (a new
rank, alpha or target modules came with a new anchor: the live adapter's shapes and
scaling no longer fit; the replica restarts on it), saying what changed. Everything else is a hot-load
like any other: :class:`LoraHotSwapper` is the HotSwapper over the adapter's live
tensors (an engine gives them as a mapping from peft's saved names), so prepare,
pause, rollback and proof are the full-model ones.

An engine adds the loading (loader/engines/reference/lora.py: peft on the reference
decode loop); a vLLM engine would keep this module's checks and give its LoRA slot's
host copy to the swapper with an applier.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from ckptdelta.delta.lora_record import ADAPTER_CONFIG_NAME, AdapterRecord, describe_config_change
from ckptdelta.delta.errors import CkptDeltaError, HotLoadError, NotServableError
from ckptdelta.delta.manifest import Manifest, snapshot_name

from ckptdelta.loader.hotswap import HotSwapper, PreparedUpdate

if TYPE_CHECKING:
    from ckptdelta.loader.reader import SnapshotReader

log = logging.getLogger("ckptdelta.loader.lora")


def adapter_record(reader: "SnapshotReader", version: int) -> AdapterRecord | None:
    """The snapshot's adapter record: None for a full-model run."""
    return reader.manifest(version).adapter


def base_dir_for(record: AdapterRecord, base_model: str | None, where: str) -> str:
    """The directory to load the base from: ``base_model`` when given, else the record's name when it is a
    local model directory; else one line saying to give ``--base-model DIR``."""
    if base_model is not None:
        return base_model
    if os.path.isfile(os.path.join(record.base_model, "config.json")):
        return record.base_model
    raise NotServableError(f"{where} is a LoRA adapter for {record.describe_base()}, which is not a model "
                           "directory here: give the base with --base-model DIR (base_model= in build())")


def check_base(record: AdapterRecord, digest: str, base_dir: str, where: str) -> None:
    """Refuse a base whose weights are not the ones the adapter was trained on, naming both."""
    if digest != record.base_xxh3:
        raise NotServableError(f"{where} is a LoRA adapter for {record.describe_base()}, but the base at "
                               f"{base_dir} has weights xxh3 {digest}: serve it on the base it was trained on "
                               "(--base-model DIR)")


def check_target(live: AdapterRecord, base_xxh3: str, target: Manifest, *, reader: "SnapshotReader | None" = None,
                 live_version: int | None = None) -> None:
    """Refuse a hot-load whose target is not an adapter for this base and this adapter config; given the reader
    and the live version, the refusal of another config says what changed (both anchors' adapter_config.json)."""
    rec = target.adapter
    if rec is None:
        raise HotLoadError(f"{target.where()} is not a LoRA adapter (it records no base model): a replica serving "
                           "an adapter cannot load it")
    if rec.base_xxh3 != base_xxh3:
        raise HotLoadError(f"{target.where()} is a LoRA adapter for {rec.describe_base()}; this replica serves "
                           f"base {live.base_model!r} (weights xxh3 {base_xxh3}): restart it on that base "
                           "(--base-model DIR)")
    if rec.config_xxh3 != live.config_xxh3:
        change = _config_change(reader, live_version, target.version) if reader is not None else None
        of = "" if live_version is None else f" of {snapshot_name(live_version)}"
        raise HotLoadError(f"{target.where()} has another adapter config (xxh3 {rec.config_xxh3}) than the live "
                           f"adapter{of} (xxh3 {live.config_xxh3}): {change or 'a new rank, alpha or target modules'}"
                           "; a replica hot-loads only adapters of the config it started with: restart it on this "
                           f"one (ckptdelta serve --snapshot {target.name})")


def _config_change(reader: "SnapshotReader", old: int | None, new: int) -> str | None:
    """What changed between two snapshots' adapter configs, as the publisher's anchor reason says it (``r 4 ->
    8``); None when either cannot be read (the refusal stands, said without it)."""
    def config(version: int) -> dict[str, Any]:
        ref = next(r for name, r in reader.extra_files(version) if name == ADAPTER_CONFIG_NAME)
        d = json.loads(reader.read_object(ref))
        if not isinstance(d, dict):
            raise ValueError(f"{ADAPTER_CONFIG_NAME} of {snapshot_name(version)} is not a JSON object")
        return d

    if old is None:
        return None
    try:
        change = describe_config_change(config(old), config(new))
    except (CkptDeltaError, StopIteration, ValueError) as e:
        log.debug("cannot say what changed between the adapter configs of %s and %s: %s", snapshot_name(old),
                  snapshot_name(new), e)
        return None
    return change.removeprefix("the adapter config changed: ")


class LoraHotSwapper(HotSwapper):
    """A HotSwapper over a LoRA adapter's live tensors that first checks the target is an adapter for the same
    base and adapter config (:func:`check_target`). ``record`` is the live adapter's; ``base_xxh3`` the digest
    of the base the replica loaded."""

    def __init__(self, weights: Any, reader: "SnapshotReader", *, record: AdapterRecord, base_xxh3: str,
                 priors: dict | None = None, **kwargs: Any) -> None:
        super().__init__(weights, reader, **kwargs)
        self.record, self.base_xxh3 = record, base_xxh3
        self.keep_priors = True     # an adapter's deltas are coded against their grandparent too (small copies)
        # what the initial materialization kept (SnapshotReader.materialize(priors=...)): without it, the first
        # hot-load whose records need the bits before the live version takes the anchor route
        self._priors.update(priors or {})

    def _prepare(self, target: "str | int", initial: bool) -> PreparedUpdate:
        v = self.reader.resolve(target)        # once: "latest" must not move between the check and the plan
        check_target(self.record, self.base_xxh3, self.reader.manifest(v), reader=self.reader,
                     live_version=self.version)
        log.debug("hot-load to %s: an adapter for the live base and config", snapshot_name(v))
        return super()._prepare(v, initial)
