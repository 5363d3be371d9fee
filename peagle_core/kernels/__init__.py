"""Triton kernels of peagle_core (CUDA; importable without triton, which is only needed to call them)."""
