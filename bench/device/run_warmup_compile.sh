#!/usr/bin/env bash
# Compile warm-up of the first training steps per method (bench.warmup_compile). Carry .carry/w2 (pydantic wheels).
# PYTHONFAULTHANDLER and SIGABRT on timeout print the stack of a step that never ends.
# Usage: bash bench/device/run_warmup_compile.sh [STEPS [METHODS...]]   (default 20 eagle3 peagle)
set -u
. bench/device/env.sh
python3 -c "import pydantic" 2>/dev/null || python3 -m pip install -q --no-deps --no-index --target ~/keep/site \
  .carry/w2/pydantic*.whl .carry/w2/annotated*.whl .carry/w2/typing*.whl
STEPS=${1:-20}; shift 2>/dev/null; METHODS=${*:-eagle3 peagle}
PYTHONFAULTHANDLER=1 timeout -s ABRT 540 python3 -m bench.warmup_compile --methods $METHODS --steps "$STEPS" 2>&1 | tail -12
save
