"""A random-weight target of a public model's shape as a local HF directory, loaded by the product like any target
(``target.model: DIR`` in a recipe, ``bench.capture_throughput --target DIR``): capture and training cost at a real
target size, with nothing downloaded or carried (issue 40 item 4: capture "on the Llama-3.1-8B shape with random
weights, where the forward dominates").

The shape is :data:`bench.synthetic_serving.TARGET_CONFIGS`'s (the public ``config.json``); the tokenizer, chat
template and vocabulary are the embedded SmolLM2's, so the vocabulary is 49,152 rather than the shape's own (for
Llama-3.1-8B, 128,256): capture never runs the LM head, and the embedding lookup costs nothing next to the layers.
Weights: transformers' own initialisation (seeded), in ``--dtype``, written as safetensors by ``save_pretrained``.
The directory is built in a temp sibling and renamed into place (``peagle_core.atomic.replace_dir``).

    python -m bench.random_target llama-3.1-8b ~/keep/targets/llama-3.1-8b-random --device cuda   # ~16 GB
    python -m bench.random_target tiny-llama /tmp/tiny-random                                     # CPU smoke

Bytes per captured token: 2 x (number of aux layers + 1) x hidden size in bfloat16 (the three aux hidden states
and the final one): 4,608 for SmolLM2's 576, 32,768 for 4,096 (plus 5 for ids and mask).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.synthetic_serving import TARGET_CONFIGS


def build(shape: str, out_dir: str | Path, *, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write the random target ``shape`` (a key of ``TARGET_CONFIGS``) to ``out_dir``; returns it.

    Raises:
        KeyError: unknown ``shape``.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from peagle_core.atomic import replace_dir, temp_dir_for
    from pipelines.assets import ensure_target, text_config

    out_dir = Path(out_dir).expanduser()
    smol = ensure_target("smollm2-135m-instruct", dtype=dtype)
    vocab = {k: text_config(smol.path)[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    cfg = {k: v for k, v in TARGET_CONFIGS[shape].items() if k != "mask_token_id"} | vocab | {"torch_dtype": dtype}
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # initialise in the target dtype: half the memory of float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    finally:
        torch.set_default_dtype(previous)
    tmp = temp_dir_for(out_dir)  # creates the parent
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(smol.path).save_pretrained(tmp)
    (tmp / "random_target.json").write_text(json.dumps({"shape": shape, "seed": seed, "dtype": dtype,
                                                         "tokenizer": "smollm2-135m-instruct"}, indent=1))
    return replace_dir(tmp, out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(TARGET_CONFIGS))
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = build(args.shape, args.out_dir, device=args.device, dtype=args.dtype, seed=args.seed)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {args.shape} random weights, {size / 2**30:.2f} GiB, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
