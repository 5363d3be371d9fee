#!/usr/bin/env bash
# Session 3, call 2 (carry .carry/w2): install SmolLM2's package + gguf (+ pydantic) and convert
# the target to bfloat16 (the benchmark) and float32 (the losslessness check).
set -u
. bench/device/install_target.sh bfloat16 float32
du -sh ~/keep/peagle/targets/*
