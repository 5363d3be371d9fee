#!/usr/bin/env bash
# Carry .carry/w1 (bench/device/prepare_target_carry.sh): keep the first half of SmolLM2's wheel and the
# prompt files in ~/keep for the next calls on the same warm machine; print the GPU and its clocks.
set -u
mkdir -p ~/keep && cp .carry/w1/* ~/keep/
nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,utilization.gpu --format=csv
nproc; uptime; ls -la ~/keep
