"""The replica's note on a LoRA run published in float32 to a vLLM that holds LoRA weights in 16 bits.

vLLM rounds such an adapter to 16 bits as it takes it;
``Publisher(dtype=...)`` makes the same cast on the trainer (test_vllm_lora.py proves the slot
is the same). The note is said exactly where the cast is all that differs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ckptdelta.loader import SnapshotReader
from ckptdelta.loader.engines.vllm.dtype import lora_dtype_note
from ckptdelta.publisher import Publisher
from tests.publisher.test_lora_publish import peft_model, train_step
from tests.replicas import make_lm_dir


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_lm_dir(str(tmp_path_factory.mktemp("lm")))


@pytest.fixture(scope="module")
def fp32_manifest(lm_dir, tmp_path_factory):
    """One fp32 adapter run's manifest, read by every case that needs one (each publish costs a model)."""
    return published(lm_dir, str(tmp_path_factory.mktemp("fp32") / "run"), None)


def published(base: str, url: str, dtype: torch.dtype | None):
    model, opt = peft_model(base)
    train_step(model, opt, seed=0)
    with Publisher(url, dtype=dtype) as pub:
        version = pub.publish(model, 0).version
    return SnapshotReader(url).manifest(version)


def test_an_fp32_adapter_on_a_16_bit_lora_dtype_is_told_to_publish_in_that_dtype(fp32_manifest):
    m = fp32_manifest
    for lora_dtype, to in [("torch.bfloat16", "bfloat16"), ("torch.float16", "float16")]:
        note = lora_dtype_note(m, lora_dtype)
        assert note is not None and m.run_id in note and f"Publisher(dtype=torch.{to})" in note
        assert f"holds LoRA weights in {to}" in note


@pytest.mark.parametrize("lora_dtype", ["torch.float32", "auto", "None"])
def test_an_fp32_adapter_on_an_fp32_lora_dtype_or_one_not_reported_gets_no_note(fp32_manifest, lora_dtype):
    assert lora_dtype_note(fp32_manifest, lora_dtype) is None


def test_an_adapter_published_in_the_lora_dtype_gets_no_note(lm_dir, tmp_path):
    m = published(lm_dir, str(tmp_path / "run"), torch.bfloat16)
    assert {e.dtype for e in m.tensors.values()} == {"BF16"}
    assert lora_dtype_note(m, "torch.bfloat16") is None


def test_an_adapter_with_a_module_vllm_keeps_in_its_own_dtype_gets_no_note(fp32_manifest):
    """A module to save (peft trains it whole) is not cast by vLLM: cast on the trainer, it would differ."""
    m = fp32_manifest
    entry = next(iter(m.tensors.values()))
    whole = dataclasses.replace(m, tensors={**m.tensors, "base_model.model.lm_head.weight": entry})
    assert lora_dtype_note(whole, "torch.bfloat16") is None
