# Two commands do all set-up on a fresh machine with only python3 and make:
#   make demo   - the main job on the embedded default (a local-directory bucket)
#   make test   - the whole suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test stress bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m benchmarks.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

stress: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m benchmarks.codec
	$(BIN)/python -m benchmarks.update_latency

clean:
	rm -rf $(VENV) .ckptdelta build *.egg-info
