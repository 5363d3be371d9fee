"""Diagnostic (issue 14): a head's teacher-forced accuracy on the target's own greedy answers to eval
prompts, beside the acceptance of peagle's reference decoder on the same prompts (CPU, float32).

The training logs report per-depth accuracies on training batches (``acc_d{d}``: draft argmax == target
argmax, every anchor, teacher-forced). vLLM's acceptance on eval prompts was far lower. This separates
the two explanations on one set of sequences:

* ``teacher_forced_acc``: per depth, draft == the target's argmax, over every anchor of each prompt + the
  target's greedy answer (the P-EAGLE element layout, no COD sampling); ``..._draft_vocab_label``: the same
  against the argmax over the draft vocabulary only, the label training's ``acc_d{d}`` uses
  (``peagle_core.objectives.base.TargetHead``);
* ``chain``: per anchor, whether depths 0..d were all right (the decoder accepts position d+1 only then);
  the fraction over anchors is what ``acceptance per position`` would be if drafting happened at every anchor;
* ``decoder``: ``pipelines.evaluate.measure.offline_acceptance`` (equal to vLLM's counters, ``bench.eval_gpu_heads
  --offline-k``) on the same prompt ids.

Teacher-forced accuracies close to the decoder's acceptance mean the head decodes as it was trained and the
gap to the training logs is the data (eval prompts vs training conversations); a teacher-forced accuracy far
above the chain / decoder numbers would point at a train/decode mismatch.

    python -m bench.teacher_forced --head outputs/scale-heads/head-peagle-29k-600s --set humaneval --k 5
    (--capture-dtype bfloat16: the teacher-forced hidden states from a bfloat16 copy of the target)
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np
import torch

from bench.common import write_result

HELD_OUT_SET = "selfinstruct-heldout"


def held_out_prompts(keep: str | None, build: int, tokenizer, num: int) -> list[list[int]]:
    """Prompt ids of the first user turns (after the system turn, if any) of the first ``num`` held-out self-instruct conversations of data build
    ``build`` under ``keep`` (``bench.long_context.held_out_pool``), as evaluation tokenizes a prompt.

    Raises:
        SystemExit: no ``keep``, or fewer such conversations than ``num``.
    """
    from bench.long_context import held_out_pool
    from pipelines.data.selfinstruct import SOURCE
    from pipelines.evaluate.prompts import prompt_token_ids

    if keep is None:
        raise SystemExit(f"--set {HELD_OUT_SET} needs --keep (the regenerated set of --build {build})")
    rows, _ = held_out_pool(Path(keep), build)
    firsts = [r["messages"][:1 + [m["role"] for m in r["messages"]].index("user")]  # its system turn, if any
              for r in rows if r["id"].startswith(f"{SOURCE}/")][:num]
    if len(firsts) < num:
        raise SystemExit(f"{len(firsts)} held-out self-instruct conversations, --num-prompts {num}")
    return prompt_token_ids(firsts, tokenizer)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", required=True, help="exported P-EAGLE head directory")
    p.add_argument("--set", default="humaneval", help="eval source kind (pipelines.evaluate.prompts), or "
                   f"{HELD_OUT_SET}: first user turns of the held-out self-instruct conversations of --build under "
                   "--keep (bench.long_context.held_out_pool: the training runs' own domain, never trained on)")
    p.add_argument("--keep", default=None, help=f"with --set {HELD_OUT_SET}: the regenerated set (bench.scale --keep)")
    p.add_argument("--build", type=int, default=3, help=f"with --set {HELD_OUT_SET}: its data build")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--capture-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target dtype of the teacher-forced hidden states (bench.scale trains on bfloat16 ones)")
    p.add_argument("--name", default=None, help="result name under bench/results (default teacher_forced_<set>)")
    return p


def main(argv: list[str] | None = None) -> None:
    from peagle_core.batch import pack_samples
    from peagle_core.contract import load_head
    from peagle_core.elements import build_peagle_elements, element_hidden
    from peagle_core.masks import dense_element_mask
    from peagle_core.objectives.base import DepthStats
    from pipelines.assets import DEFAULT_TARGET, ensure_target
    from pipelines.capture import load_target
    from pipelines.capture.forward import capture_tokenized
    from pipelines.evaluate.measure import offline_acceptance
    from pipelines.evaluate.prompts import load_eval_prompts
    from pipelines.recipe import CaptureConfig, SourceConfig
    from pipelines.train import load_target_lm_head

    args = _parser().parse_args(argv)

    path = ensure_target(DEFAULT_TARGET, "float32").path
    model, tok = load_target(path, "float32")
    if args.set == HELD_OUT_SET:
        prompts = held_out_prompts(args.keep, args.build, tok, args.num_prompts)
    else:
        (prompts,) = load_eval_prompts([SourceConfig(kind=args.set)], tok, num_prompts=args.num_prompts,
                                       max_prompt_tokens=512).values()
    drafter = load_head(args.head, dtype=torch.float32,
                        target_embed_tokens=model.get_input_embeddings().weight.detach()).eval()
    K, mask_id = args.k, drafter.config.mask_token_id
    rows = []
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)[0]
            loss_mask = np.zeros(len(out), dtype=np.uint8)
            loss_mask[len(ids):] = 1
            rows.append({"sample_id": str(i), "input_ids": out.numpy().astype(np.int32), "loss_mask": loss_mask})
    capture_model = model if args.capture_dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
    samples = capture_tokenized(capture_model, rows, CaptureConfig(dtype="float32", batch_size=4),
                                drafter.config.aux_layer_ids)
    lm_head = load_target_lm_head(path).float()
    in_draft = torch.nonzero(drafter.t2d.bool()).flatten()  # target ids of the draft vocabulary
    stats, stats_restricted = DepthStats(K, torch.device("cpu")), DepthStats(K, torch.device("cpu"))
    chain, num_anchors = torch.zeros(K, dtype=torch.float64), 0
    with torch.inference_mode():
        for s in samples:
            batch = pack_samples([s], len(s["input_ids"]))[0]
            el = build_peagle_elements(batch, K, mask_id)  # every anchor and depth (no COD sampling)
            normed, _ = drafter(el.input_ids[None], element_hidden(drafter, batch, el)[None], el.position[None],
                                attn_mask=dense_element_mask(el))
            scored = torch.nonzero(el.loss).flatten()  # slots whose label lies in the answer (all slots are context)
            el = el.index(scored)
            draft = drafter.draft_to_target(drafter.compute_logits(normed[0, scored]).argmax(-1))
            zt = batch.final_hidden[el.target_index] @ lm_head.T  # [M, V] target logits after each slot
            ok = draft == zt.argmax(-1)  # the target's argmax: what greedy decoding emits there
            no_loss = torch.zeros(len(ok))
            stats.add(el.depth, no_loss, ok)
            stats_restricted.add(el.depth, no_loss, draft == in_draft[zt[:, in_draft].argmax(-1)])  # training's label
            flags = torch.zeros(batch.num_tokens, K, dtype=torch.bool)  # [anchor, depth] right
            have = torch.zeros(batch.num_tokens, K, dtype=torch.bool)
            flags[el.anchor, el.depth], have[el.anchor, el.depth] = ok, True
            full = have.all(1)  # anchors with all K depths inside the answer
            chain += flags[full].long().cumprod(1).sum(0).double()
            num_anchors += int(full.sum())
    tf, tf_restricted = stats.metrics(0.0), stats_restricted.metrics(0.0)
    ch = (chain / max(1, num_anchors)).tolist()
    dec = offline_acceptance(path, args.head, prompts, K=K, max_tokens=args.max_tokens, target_model=model)
    result = {"head": args.head, "eval_set": args.set, "K": K, "capture_dtype": args.capture_dtype,
              "prompts": len(prompts), "max_tokens": args.max_tokens,
              "teacher_forced_acc": [tf[f"acc_d{d}"] for d in range(K)],
              "teacher_forced_sim_al": tf["sim_acceptance_length"],
              "teacher_forced_acc_draft_vocab_label": [tf_restricted[f"acc_d{d}"] for d in range(K)],
              "chain_acceptance_per_pos": ch, "chain_al": 1 + sum(ch), "chain_anchors": num_anchors,
              "decoder_acceptance_per_pos": dec["al_per_pos"], "decoder_al": dec["acceptance_length"],
              "decoder_drafts": dec["num_drafts"]}
    print(result)
    write_result(args.name or f"teacher_forced_{args.set}", result)


if __name__ == "__main__":
    main()
