"""The dtype vLLM serves a run in: the snapshot's own, so that its live weights can be the published bits.

vLLM computes in the dtype ``--dtype`` names; its default, ``auto``, takes the
config's, except that float32 is downcast to a 16-bit dtype (bf16 where the
platform has it, as on x86 CPUs). A replica proves after vLLM started that the
live weights are the snapshot's bits, and a cast copy never is: an fp32 run
then failed at start as if vLLM held some other snapshot, while the cause was
only in vLLM's log ("Downcasting torch.float32 to torch.bfloat16"). So a
replica that starts vLLM passes ``--dtype`` of the snapshot's floating-point
tensors unless the user gave one, and refuses one that would cast them before
vLLM starts, in one line that says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptdelta.delta.errors import NotServableError
from ckptdelta.delta.hf import config_dtype
from ckptdelta.delta.manifest import Manifest, snapshot_name

#: vLLM's --dtype spellings (vllm.config.model._STR_DTYPE_TO_TORCH_DTYPE) and the dtype each names.
VLLM_DTYPES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
               "bfloat16": "bfloat16"}


def given_dtype(args: Sequence[str]) -> str | None:
    """The value of ``--dtype`` in vLLM's arguments (the last one, as argparse takes it), or None."""
    found = None
    for i, a in enumerate(args):
        if a == "--dtype" and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith("--dtype="):
            found = a.split("=", 1)[1]
    return found


def dtype_args(args: Sequence[str], manifest: Manifest) -> list[str]:
    """vLLM's arguments with ``--dtype`` of ``manifest``'s floating-point tensors added where the user gave
    none; NotServableError when the one given would make vLLM serve a cast copy of them. A snapshot of
    several floating-point dtypes is left to vLLM (the publisher warned: no single dtype serves it)."""
    want = config_dtype(e.dtype for e in manifest.tensors.values())
    given = given_dtype(args)
    if want is None:
        return list(args)
    if given is None:
        return [*args, "--dtype", want]
    what = f"{snapshot_name(manifest.version)} of run {manifest.run_id}"
    key = given.lower()
    if key == "auto":
        if want != "float32":
            return list(args)
        served, to = "a 16-bit dtype (--dtype auto downcasts float32)", "bfloat16"
    elif key in VLLM_DTYPES:
        if VLLM_DTYPES[key] == want:
            return list(args)
        served, to = f"{VLLM_DTYPES[key]} (--dtype {given})", VLLM_DTYPES[key]
    else:
        return list(args)          # vLLM refuses a dtype it does not know, in its own words
    raise NotServableError(
        f"vLLM would serve {what} in {served}, but its weights are {want}: a cast copy is not the published "
        f"bits, which a replica must serve. Leave --dtype out (the replica then passes --dtype {want}), or "
        f"publish the run in the dtype to serve (Publisher(dtype=torch.{to}))")


#: vLLM's 16-bit LoRA dtypes, as its workers report them (``str(torch.dtype)``), and the name each goes by.
LORA_16_BIT = {"torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def lora_dtype_note(manifest: Manifest, lora_dtype: str | None) -> str | None:
    """One line for a LoRA run published in float32 to a vLLM that holds LoRA weights in 16 bits, or None.

    vLLM casts every lora_A and lora_B weight to its LoRA dtype (``--lora-dtype``; ``auto``: the model's) first
    thing as it takes an adapter, before it scales or packs anything, by torch's round to nearest even: it
    keeps 16 bits of each fetched fp32 element. Publishing with ``Publisher(dtype=...)`` makes that very
    cast on the trainer, so the slot holds the same bits (tests/loader/engines/vllm/test_vllm_lora.py proves it
    against vLLM's own load of the fp32 directory), and each step ships what the replica serves: several times
    fewer bytes (docs/PERFORMANCE.md). Said only where the cast is all that differs: every tensor a lora_A or
    lora_B weight (vLLM keeps other tensors, a module to save, in their own dtype; an embedding's LoRA, which it
    casts too, is left out: no test holds it) and every one float32."""
    to = LORA_16_BIT.get(lora_dtype)
    entries = manifest.tensors
    if to is None or not entries or any(e.dtype != "F32" for e in entries.values()) or \
            any(".lora_A." not in n and ".lora_B." not in n for n in entries):
        return None
    return (f"run {manifest.run_id} publishes its adapters in float32, and this vLLM holds LoRA weights in {to} "
            f"(--lora-dtype; auto: the model's dtype): it rounds every fetched element to {to} as it loads it. "
            f"Publisher(dtype=torch.{to}) makes the same cast on the trainer, which keeps its fp32 adapter and "
            f"optimizer: vLLM replicas then hold the same LoRA weights, bit for bit, from steps several times "
            f"smaller" + (", and keep_exact=True keeps the fp32 bits in the run too, for the readers that need them"
                          if to == "bfloat16" else "") + " (docs/SERVING.md, \"LoRA runs\")")
