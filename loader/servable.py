"""Whether a replica can serve what it was given, checked before anything is downloaded or loaded.

Without these checks a snapshot published without a tokenizer, a mistyped
``--model`` path or ``--device cuda`` on a machine without one fails deep inside
transformers or torch, after the snapshot was materialized, with a message that
names neither the snapshot nor the fix. Each check raises NotServableError with
one line saying what is missing and how to add it. ``ckptdelta serve`` runs them
for both engines (ckptdelta/cli/serve.py); :func:`ckptdelta.loader.engines.reference.model.load_engine` runs them too.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ckptdelta.delta.errors import NotServableError
from ckptdelta.delta.hf import serving_gaps
from ckptdelta.delta.manifest import snapshot_name

if TYPE_CHECKING:
    from ckptdelta.loader.reader import SnapshotReader

_WEIGHTS = (".safetensors", ".bin")


def check_snapshot(reader: "SnapshotReader", version: int) -> None:
    """The snapshot's extra files (its anchor's) hold config.json and a tokenizer. A LoRA run's snapshot is an
    adapter: its base model directory brings them (loader/lora.py)."""
    chain = reader.chain(version)
    if chain[-1].adapter is not None:
        return
    names = [rel for rel, _obj in reader.extra_files(version)]
    gaps = serving_gaps(names)
    if gaps:
        raise NotServableError(
            f"{snapshot_name(version)} of run {reader.run_id} at {reader.url} cannot be served: its anchor "
            f"{chain[0].name} carries no {' and no '.join(gaps)}; publish an anchor that does: "
            "Publisher(URL, extra_files=MODEL_DIR).publish(model, step, anchor=True), or "
            "ckptdelta publish MODEL_DIR URL --step N --anchor (MODEL_DIR: where the model and its tokenizer "
            "were saved with save_pretrained)")


def check_model_dir(path: str) -> None:
    """``path`` is a Hugging Face model directory transformers can load: config.json, a tokenizer, weights."""
    if not os.path.isdir(path):
        raise NotServableError(f"model directory {path} does not exist (give a directory that holds config.json, "
                               "the tokenizer's files and safetensors weights, as save_pretrained writes it)")
    names = os.listdir(path)
    gaps = serving_gaps(names)
    if not any(n.endswith(_WEIGHTS) for n in names):
        gaps.append("weights (*.safetensors)")
    if gaps:
        raise NotServableError(f"model directory {path} cannot be served: it holds no {' and no '.join(gaps)} "
                               "(save them there with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR))")


def check_device(device: str) -> None:
    """``device`` parses as a torch device and this machine has it. A malformed name is a ValueError."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, mps ...): {e}") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise NotServableError(f"--device {device}: this machine has no usable CUDA device (torch "
                                   f"{torch.__version__}, {build}); serve with --device cpu")
        if dev.index is not None and dev.index >= n:
            raise NotServableError(f"--device {device}: this machine has {n} CUDA device{'s' if n > 1 else ''} "
                                   f"(cuda:0{f'..cuda:{n - 1}' if n > 1 else ''})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise NotServableError(f"--device {device}: MPS is not available on this machine; serve with --device cpu")
