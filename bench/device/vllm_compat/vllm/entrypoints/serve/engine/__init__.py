"""Alias package for Ray 2.60's ray.llm on vLLM 0.26 (see bench/device/vllm_compat/README.md)."""
