"""The files an anchor carries beside its weights, so a replica can load it with transformers: the model's
config (made to describe the tensors published), its generation config, tokenizer files.

A replica serves an anchor as a Hugging Face model directory, so its config.json must describe exactly the
tensors published (dtype, tying); a config that does not is fixed or refused here, once per run, with the
reason logged, rather than found out by a replica that serves other numbers."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from ckptdelta.delta import dtypes
from ckptdelta.delta.hf import CONFIG_FILE, DTYPE_FIELDS, config_differences, reconcile_config, serving_gaps

from ckptdelta.publisher import anchor as anchor_fmt
from ckptdelta.publisher.host_copy import Schema, Weights
from ckptdelta.publisher.tied import tied_aliases

log = logging.getLogger("ckptdelta.publisher")


class AnchorFiles:
    """``Publisher(extra_files=...)`` and what the first publish's model adds to them."""

    def __init__(self, extra_files: Mapping[str, str | os.PathLike[str] | bytes] | str | os.PathLike[str] | None,
                 *, dtype: torch.dtype | None) -> None:
        self.files = anchor_fmt.read_extra_files(extra_files)
        self.checked = False     # the model's own config added and serving gaps warned about (first publish)
        self.rank = 0            # this process's rank among the publishers: rank 0 alone logs
        self._dtype = dtype
        self._where = "extra_files' config.json"   # where the anchors' config.json comes from
        self._said: set[tuple] = set()              # config fixes and warnings already logged

    def check(self, weights: Weights, run_id: str, url: str) -> None:
        """First publish: a transformers model's own config (in the dtype published) replaces extra_files'
        (the model is what is published), its generation config is added where extra_files has none, its
        tied aliases are named; warn (once) when anchors would lack what serving needs."""
        self.checked = True
        is_model = isinstance(weights, torch.nn.Module)
        if is_model:
            own = anchor_fmt.model_files(weights, self._dtype)
            if own:
                given = self.files.get(CONFIG_FILE)
                differ = config_differences(given, own[CONFIG_FILE]) if given is not None else []
                if self._dtype is not None:
                    # fp32 masters published in Publisher(dtype=...): the model directory was saved from them, so
                    # its config names their dtype; the anchors' naming the published one is the point, not news
                    cast = [d for d in differ if d.split(":", 1)[0] in DTYPE_FIELDS]
                    differ = [d for d in differ if d not in cast]
                    if cast and self.rank == 0:
                        log.info("run %s: anchors' config.json names the dtype published (%s), where extra_files' "
                                 "names the trainer's", run_id, ", ".join(cast))
                if differ and self.rank == 0:
                    log.warning("run %s: extra_files' config.json differs from the config of the %s published "
                                "(%s); anchors carry the model's own", run_id, type(weights).__name__,
                                ", ".join(differ))
                # one assignment: an anchor being written keeps its dict
                self.files = {**own, **self.files, CONFIG_FILE: own[CONFIG_FILE]}
                self._where = f"the config of the {type(weights).__name__} published"
            aliases = tied_aliases(weights, weights.state_dict())
            if aliases and self.rank == 0:
                log.info("run %s: tied weights are published once, as save_pretrained writes them: %s",
                         run_id, ", ".join(f"{a} (= {s})" for a, s in sorted(aliases.items())))
        gaps = serving_gaps(self.files)
        if gaps and (is_model or self.files) and self.rank == 0:
            log.warning("run %s at %s: anchors will carry no %s, so `ckptdelta serve` refuses them; pass "
                        "extra_files=MODEL_DIR (the directory the model and its tokenizer were saved to)",
                        run_id, url, " and no ".join(gaps))

    def for_schema(self, schema: Schema, run_id: str) -> dict[str, bytes]:
        """The extra files an anchor of ``schema`` carries: its config.json made to describe those tensors
        (ckptdelta.delta.hf.reconcile_config: a wrong dtype fixed, a wrong tying refused), each fix logged once."""
        config = self.files.get(CONFIG_FILE)
        if config is None:
            return self.files
        floats = sorted({d for d, _ in schema.values() if dtypes.by_name(d).torch_dtype.is_floating_point})
        if len(floats) > 1 and ("mixed", *floats) not in self._said and self.rank == 0:
            self._said.add(("mixed", *floats))
            log.warning("run %s: the tensors published hold several floating-point dtypes (%s); replicas load a "
                        "model's weights in the one dtype of its config.json, so they cannot serve these bits "
                        "exactly: publish one (Publisher(dtype=torch.bfloat16))", run_id, ", ".join(floats))
        fixed, fixes = reconcile_config(config, {n: d for n, (d, _) in schema.items()},
                                        where=f"run {run_id}: {self._where}")
        if not fixes:
            return self.files
        if ("fix", *fixes) not in self._said:
            self._said.add(("fix", *fixes))
            own = self._where.startswith("the config of")
            log.log(logging.INFO if own else logging.WARNING,
                    "run %s: %s does not describe the tensors published; anchors carry it with %s",
                    run_id, self._where, ", ".join(fixes))
        return {**self.files, CONFIG_FILE: fixed}
