"""peagle_core: the P-EAGLE drafter, objective, partitioning and vLLM checkpoint contract (pure PyTorch)."""
