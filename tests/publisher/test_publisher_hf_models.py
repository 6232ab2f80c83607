"""What the publisher does with a Hugging Face policy: fp32 masters published in bf16, tied weights once,
configs that describe the published tensors (issue 31 items 1-3). The serving side is tests/loader/engines/vllm/test_hf_policies.py."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from ckptdelta.delta.errors import NotServableError, PublishInputError
from ckptdelta.publisher import Publisher
from tests.publisher_helpers import snapshot, versions
from tests.vllm_replicas import bits


def tied_llama(*, tied: bool = True, vocab: int = 48, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def anchor_config(store, version: int) -> dict:
    from ckptdelta.loader.reader import SnapshotReader

    reader = SnapshotReader(store.url)
    extra = dict(reader.extra_files(version))
    return json.loads(reader.read_object(extra["config.json"]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# --- dtype ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device_diff", [False, True], ids=["copy", "device-diff"])
def test_dtype_publishes_floating_tensors_cast_and_integer_ones_as_they_are(tmp_path, device_diff):
    g = torch.Generator().manual_seed(0)
    w = {"w": torch.randn(40, 24, generator=g), "half": torch.randn(16, generator=g).half(),
         "nan": torch.tensor([float("nan"), -0.0, 1e-40, 3.0e38]), "steps": torch.tensor([7, 1 << 40]),
         # NaNs with payloads (signalling, negative), and a transposed (non-contiguous) master: each cast as it
         # is copied to the host gives .to()'s very bits
         "payloads": torch.tensor([0x7F800001, -0x003FFEDD, 0x7FC00ABC, 0x00000001], dtype=torch.int32).view(
             torch.float32),
         "transposed": torch.randn(24, 40, generator=g).t(), "bf16": torch.randn(8, generator=g).bfloat16(),
         "nans": torch.randn(64, 24, generator=g),
         "mask": torch.tensor([True, False]), "np": np.linspace(-2, 2, 9, dtype=np.float32)}
    for t in (w["transposed"], w["nans"]):     # NaNs past the conversion kernels' vector width
        t[::3, ::5] = float("nan")
    with Publisher(str(tmp_path / "run"), dtype=torch.bfloat16, device_diff=device_diff) as pub:
        for step in range(3):
            pub.publish(w, step)
            got = snapshot(pub.store, step)
            for n, t in w.items():
                src = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
                want = src.to(torch.bfloat16) if src.is_floating_point() else src
                assert same_bits(torch.as_tensor(got[n]), want), (step, n)
            # only the published bits reached the host: the copy the publisher keeps is bf16, not fp32
            assert {t.dtype for n, t in pub._parents.tensors.items() if n in ("w", "nan", "np")} == {torch.bfloat16}
            w["w"] = w["w"] + 0.01 * torch.randn(40, 24, generator=g)      # an fp32 master step
            w["transposed"].add_(0.01 * torch.randn(40, 24, generator=g))
    assert all(isinstance(v, torch.Tensor) for v in w.values() if not isinstance(v, np.ndarray))


def test_dtype_must_be_a_floating_point_torch_dtype(tmp_path):
    for bad in (torch.int32, "bfloat16", torch.complex64):
        with pytest.raises(ValueError, match="dtype"):
            Publisher(str(tmp_path / "run"), dtype=bad)


# --- tied weights -----------------------------------------------------------------------------------------

def test_a_tied_model_is_published_once_as_save_pretrained_writes_it(tmp_path, caplog):
    from safetensors.torch import load_file

    model = tied_llama()
    model.save_pretrained(tmp_path / "saved")
    with caplog.at_level(logging.INFO, logger="ckptdelta.publisher"), Publisher(str(tmp_path / "run")) as pub:
        pub.publish(model, 0)
        got = snapshot(pub.store, 0)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(got) == sorted(saved) and "lm_head.weight" not in got
    assert all(same_bits(torch.as_tensor(got[n]), saved[n]) for n in saved)
    assert any("lm_head.weight (= model.embed_tokens.weight)" in r.getMessage() for r in caplog.records)
    untied = tied_llama(tied=False)
    with Publisher(str(tmp_path / "untied")) as pub:
        pub.publish(untied, 0)
        assert "lm_head.weight" in snapshot(pub.store, 0)
    assert anchor_config(pub.store, 0)["tie_word_embeddings"] is False


# --- configs ----------------------------------------------------------------------------------------------

def test_a_modules_own_config_replaces_a_stale_one_from_extra_files_with_a_warning_naming_the_fields(tmp_path,
                                                                                                   caplog):
    model = tied_llama()
    stale = tmp_path / "model_dir"
    tied_llama(tied=False).save_pretrained(stale)            # an untied fp32 config, and weights to skip
    (stale / "tokenizer.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"):
        with Publisher(str(tmp_path / "run"), dtype=torch.bfloat16, extra_files=str(stale)) as pub:
            pub.publish(model, 0)
            pub.publish(model, 1, anchor=True)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "tie_word_embeddings: false -> true" in warning and "dtype" not in warning   # the cast asked for
    for v in (0, 1):
        config = anchor_config(pub.store, v)
        assert config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
        assert config["architectures"] == ["LlamaForCausalLM"]


def test_fp32_masters_published_in_bf16_with_the_directory_they_were_saved_to_warn_of_nothing(tmp_path, caplog):
    """The documented path (README, PUBLISHING.md): the trainer's fp32 model saved to its directory, published
    with Publisher(dtype=torch.bfloat16, extra_files=that directory). The config's dtype differs by the cast
    asked for: the anchors carry bfloat16, and nothing warns."""
    model = tied_llama()
    saved = tmp_path / "model_dir"
    model.save_pretrained(saved)
    (saved / "tokenizer.json").write_text("{}")
    (saved / "tokenizer_config.json").write_text("{}")
    with caplog.at_level(logging.INFO, logger="ckptdelta.publisher"):
        with Publisher(str(tmp_path / "run"), dtype=torch.bfloat16, extra_files=str(saved)) as pub:
            pub.publish(model, 0)
            pub.publish(model, 1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("names the dtype published" in r.getMessage() for r in caplog.records)
    assert anchor_config(pub.store, 0)["dtype"] == "bfloat16"


def test_a_config_whose_dtype_is_not_the_tensors_is_fixed_with_one_warning(tmp_path, caplog):
    config = json.dumps({"model_type": "llama", "dtype": "float32", "torch_dtype": "float32"}).encode()
    w = {"model.embed_tokens.weight": torch.randn(8, 4).to(torch.bfloat16),
         "lm_head.weight": torch.randn(8, 4).to(torch.bfloat16), "steps": torch.tensor([3])}
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"):
        with Publisher(str(tmp_path / "run"), extra_files={"config.json": config}) as pub:
            for step in range(3):
                pub.publish(w, step, anchor=True)
    fixes = [r.getMessage() for r in caplog.records if "config.json" in r.getMessage()]
    assert len(fixes) == 1 and "dtype: float32 -> bfloat16, torch_dtype: float32 -> bfloat16" in fixes[0]
    for v in range(3):
        assert anchor_config(pub.store, v) == {"model_type": "llama", "dtype": "bfloat16", "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("tie,names,field", [
    (True, ["model.embed_tokens.weight", "lm_head.weight"], "tie_word_embeddings: true"),
    (False, ["model.embed_tokens.weight"], "tie_word_embeddings: false"),
], ids=["tied-config-with-a-head", "untied-config-without-one"])
def test_a_config_that_contradicts_the_tensors_on_tying_is_refused(tmp_path, tie, names, field):
    config = json.dumps({"model_type": "llama", "tie_word_embeddings": tie}).encode()
    w = {n: torch.randn(8, 4).to(torch.bfloat16) for n in names}
    with Publisher(str(tmp_path / "run"), extra_files={"config.json": config}) as pub:
        with pytest.raises(PublishInputError, match=f"extra_files' config.json says {field}.*lm_head"):
            pub.publish(w, 0)
        assert versions(pub.store) == []


def test_a_state_dict_of_a_tied_model_under_its_config_is_refused_saying_to_publish_the_module(tmp_path):
    model = tied_llama()
    files = {"config.json": model.config.to_json_string().encode()}
    with Publisher(str(tmp_path / "run"), extra_files=files) as pub:
        with pytest.raises(PublishInputError, match="Publish the module itself"):
            pub.publish(model.state_dict(), 0)
        pub.publish(model, 0)          # the module: its tied head once, under the same config
        assert "lm_head.weight" not in snapshot(pub.store, 0)


# --- a change of dtype, and replicas ----------------------------------------------------------------------

def test_a_replica_on_fp32_weights_refuses_the_bf16_anchor_as_the_warning_says(tmp_path, caplog):
    from ckptdelta.delta.errors import ShapeMismatchError
    from ckptdelta.loader.engines.reference.model import load_engine
    from tests.lm import build_tokenizer

    tokenizer = build_tokenizer()
    model = tied_llama(vocab=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "tok")
    url = str(tmp_path / "run")
    with Publisher(url, extra_files=str(tmp_path / "tok")) as pub:
        pub.publish(model, 0)                                       # fp32: the config says so
        assert anchor_config(pub.store, 0)["dtype"] == "float32"
    old, _ = load_engine(bucket=url, snapshot=0)
    assert old.model.dtype == torch.float32                         # the replica serves the published fp32 bits
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"):
        with Publisher(url, extra_files=str(tmp_path / "tok"), dtype=torch.bfloat16) as pub:   # now in bf16
            r = pub.publish(model, 1)
    assert r.kind == "anchor" and "dtype/shape changed" in r.schema_change
    (msg,) = [x.getMessage() for x in caplog.records]
    assert "whose live tensors are v00000000's refuses it" in msg and "--snapshot v00000001" in msg
    with pytest.raises(ShapeMismatchError, match="F32"):
        old.swapper.hotload(1)
    new, _ = load_engine(bucket=url, snapshot=1)                  # restarted on it, as the warning says
    assert new.model.dtype == torch.bfloat16 and new.version == 1


def test_a_vllm_replica_refuses_a_dtype_that_would_cast_the_run_before_vllm_starts(tmp_path):
    from ckptdelta.loader.engines import build_engine
    from ckptdelta.loader.engines.vllm.dtype import dtype_args
    from tests.lm import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    url = str(tmp_path / "run")
    with Publisher(url, extra_files=str(tmp_path / "tok")) as pub:
        pub.publish(tied_llama(vocab=len(tokenizer)), 0)            # an fp32 run
        m = pub.store
    for given in (["--dtype", "bfloat16"], ["--dtype=auto"], ["--dtype", "half"]):
        with pytest.raises(NotServableError, match="its weights are float32.*Leave --dtype out"):
            build_engine("vllm", bucket=url, snapshot=0, cache_dir=str(tmp_path / "cache"), vllm_args=given)
    from ckptdelta.loader.reader import SnapshotReader

    manifest = SnapshotReader(m.url).manifest(0)
    assert dtype_args(["--enforce-eager"], manifest) == ["--enforce-eager", "--dtype", "float32"]
    assert dtype_args(["--dtype", "float"], manifest) == ["--dtype", "float"]     # vLLM's name for float32
