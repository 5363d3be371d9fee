"""Issue 25 item 2: peagle's drafter against a record of vLLM's own drafter forward on the GPU, checked here.

``tests/integration/test_vllm_parity.py`` runs vLLM in a subprocess (``tests.integration.vllm_drafter_probe``)
with the same seed-0 random P-EAGLE head for SmolLM2 and records vLLM's first drafter forward (prefill:
shifted prompt, bonus token, K-1 mask slots). On the H100 with vLLM 0.26 (bfloat16, 2026-11-24) the record's
*input* hidden states were taken after the forward, which on CUDA has overwritten them (layer 0's residual
aliases the input and the fused add-RMSNorm writes into it; the probe now clones first), so the test's replay
failed there. Its outputs (``normed``, ``prenorm``, ``logits``) and the slot layout are intact: this script
rebuilds the inputs the way vLLM builds them (``fc`` of the HF target's aux hidden states, ``fc(mask_hidden)``
for mask slots; bfloat16 on CPU), replays peagle's drafter and compares with vLLM's outputs.

    python -m bench.vllm_parity_record bench/data/parity/vllm-0.26-h100-bf16.safetensors
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file

from bench.common import write_result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over the largest |b|."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from peagle_core.drafter import Eagle3Drafter
    from peagle_core.drafter_config import DrafterConfig
    from peagle_core.target import target_forward
    from pipelines.assets import ensure_target
    from tests.integration.test_vllm_parity import MASK_ID, PROMPT, TOLERANCES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record")
    ap.add_argument("--name", default="gpu_vllm_parity")
    args = ap.parse_args()
    rec = load_file(args.record)
    T = len(PROMPT)
    K = rec["logits"].shape[0]
    target_dir = ensure_target("smollm2-135m-instruct", dtype="float32").path
    torch.manual_seed(0)  # the test's head
    drafter = Eagle3Drafter(DrafterConfig.from_target(AutoConfig.from_pretrained(target_dir), mask_token_id=MASK_ID))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    drafter = drafter.eval().to(torch.bfloat16)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        aux = target_forward(target, torch.tensor([PROMPT]), drafter.config.aux_layer_ids).aux[0]  # [T, 3*Ht]
        hidden = torch.cat([drafter.combine_hidden_states(aux), drafter.mask_slot_hidden().expand(K - 1, -1)])
        normed, prenorm = drafter(rec["input_ids"][None], hidden[None], rec["positions"][None])
        logits_same_input = drafter.compute_logits(rec["logits_input"])
        logits = drafter.compute_logits(normed[0, T - 1:])  # [K, V]
    res = {
        "record": args.record, "vllm": ".".join(map(str, rec["vllm_version"].tolist())), "K": K,
        "slot_layout_ok": rec["input_ids"][:T - 1].tolist() == PROMPT[1:]
        and rec["input_ids"][T:].tolist() == [MASK_ID] * (K - 1) and rec["positions"].tolist() == list(range(T + K - 1)),
        "normed_rel": _rel(normed[0], rec["normed"]), "prenorm_rel": _rel(prenorm[0], rec["prenorm"]),
        "mask_slots_normed_rel": _rel(normed[0, T:], rec["normed"][T:]),
        "logits_same_input_rel": _rel(logits_same_input, rec["logits"]), "logits_rel": _rel(logits, rec["logits"]),
        "argmax_peagle": logits.argmax(-1).tolist(), "argmax_vllm": rec["logits"].float().argmax(-1).tolist(),
        "tolerance_rel": TOLERANCES[rec["logits"].dtype]["replay"],
        "inputs": "rebuilt from the HF target (bfloat16, CPU): the record's inputs were overwritten on CUDA",
    }
    res["argmax_agree"] = res["argmax_peagle"] == res["argmax_vllm"]
    print(res)
    write_result(args.name, res)


if __name__ == "__main__":
    main()
