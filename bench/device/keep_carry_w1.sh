#!/usr/bin/env bash
# Carry .carry/w1 (bench/device/prepare_target_carry.sh): keep the first part of SmolLM2's wheel and the
# prompt files in ~/keep for the next calls on the same warm machine.
exec bash bench/device/keep_carry.sh .carry/w1
