"""Is vLLM usable here? Print its version and the GPU, then generate a few greedy tokens with a tiny
random-weight Llama (``load_format="dummy"``, no tokenizer: prompt token ids in, token ids out), so the check
needs no model files. Exit status 1 when anything fails.

    python3 bench/device/vllm_check.py
"""

import json
import sys
import tempfile
import time
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 1024, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def main() -> int:
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA GPU'}")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(TINY_LLAMA))
        llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, max_model_len=512,
                  gpu_memory_utilization=0.2, enforce_eager=True)
        out = llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                                detokenize=False))
        ids = list(out[0].outputs[0].token_ids)
    print(f"generated {len(ids)} tokens {ids} in {time.perf_counter() - t0:.1f} s (import + engine start)")
    return 0 if len(ids) == 8 else 1


if __name__ == "__main__":
    sys.exit(main())
