"""Which compact checkpoint resumes a run without a loss spike, and how big each form is for the scaling heads
(issue 26 item 2: training that outlives a lent machine).

A ``run_scale.sh train`` call returns the run's latest checkpoint in a compact form
(``pipelines.train.compact.FORMS``) so that a new machine resumes from it. Two measurements:

* **Sizes**: the scaling table's heads (``bench.scale_train``: ``configs/smollm2-135m-scale.yaml`` with
  ``TRAIN_OVERRIDES``, SmolLM2's dims from ``bench.common.TARGET_SHAPES``; P-EAGLE 4 layers, EAGLE-3 1 layer,
  draft vocabulary 8192, frozen target embeddings), built on CPU with random weights (no target weights),
  one AdamW step taken so that the optimizer holds its moments, saved by the product's ``Checkpointer`` and
  compacted into every form: bytes of the files and of the returned tar, its parts, whether it fits one
  call's return (``RETURN_PARTS`` files, ``RETURN_BYTES`` together), how many calls return it (the parts over
  one call's return are held back for ``run_scale.sh rest``) and whether it fits one call's carry
  (``CARRY_BYTES``).
* **Resume**: a tiny random target (Llama, 8 layers, H=48, vocab 257, its ``lm_head`` scaled so that its
  next-token distributions are text-like, ~2.7 nats) writes the training text (sampled continuations of
  random prompts: the target's own text, as regeneration gives), the product's capture
  (``pipelines.capture.capture_tokenized``)
  takes its hidden states, and the product's plan pieces (``TrainPlan``, ``build_drafter``: vocabulary
  mapping from the counts, init from the target, frozen embeddings), objective and trainer
  (``pipelines.train.train_in_process``, checkpoints by ``Checkpointer``) train a head with the scaling
  recipe's ``training`` section (lr, betas, weight decay, clip, K or TTT steps; CPU sizes for batch,
  warm-up and horizon). Per method: one uninterrupted run of ``--steps`` steps; one stopped right after its
  checkpoint at ``--steps // 2``; for each form, that checkpoint compacted, packed into parts and unpacked
  in another directory (``bench.scale_train.return_checkpoint`` / ``restore_checkpoint``, the device path),
  then a fresh process-state (a new drafter built the same way) resumed from it for ``--window`` steps.
  Reported per form: the loss difference to the uninterrupted run at the same steps (same batches, same
  COD draws), max |diff| and mean diff (> 0: the resumed run is worse) over the window. **Noise**: the per-step
  noise of the uninterrupted loss curve over the window (the std of the loss minus its centred 9-step moving
  average). A form **matches** when its max |diff| stays below ``noise / sqrt(MATCH_STEPS)``, the standard
  error of a ``MATCH_STEPS``-step mean of the curve: no comparison of loss curves over that many steps could
  tell the resumed run from the uninterrupted one (a per-step difference below ``noise`` alone is not enough:
  re-initialising AdamW stays below it and still leaves the loss higher over the whole window).

``python -m bench.resume_state`` (CPU, 6 min on 2 cores) writes ``bench/results/resume_state.json``; the
form ``bench.scale_train`` returns by default (``DEFAULT_FORM``) is the smallest that matches for both
methods, among those that fit a call's return for both heads.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import TARGET_SHAPES, write_result
from bench.harness import bench_recipe
from bench.scale import LAYERS, PART_BYTES, RECIPE
from bench.scale_train import (
    CARRY_BYTES,
    DEFAULT_FORM,
    RETURN_BYTES,
    RETURN_PARTS,
    restore_checkpoint,
    return_checkpoint,
    return_groups,
    return_tar,
    train_overrides,
)
from pipelines.train.compact import FORMS, compact_checkpoint, form_bytes

RESULT = "resume_state"
TINY_TARGET = {"vocab_size": 257, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 8,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
               "tie_word_embeddings": False, "initializer_range": 0.1}
LM_HEAD_SCALE = 4.0  # the random target's next-token entropy ~2.7 nats instead of ~5.3 (near uniform)
MASK_ID = 256        # never generated (suppressed): the P-EAGLE mask token
DRAFT_VOCAB = 96
SMOOTH_STEPS = 9     # the moving average the loss noise is measured around
MATCH_STEPS = 100    # a form matches when max |diff| < noise / sqrt(MATCH_STEPS)


class _Stop(Exception):
    """Ends a run at a chosen step (raised from a callback or ``on_log``)."""


# ---------------------------------------------------------------------------------------------- sizes


def head_sizes(method: str, work: Path) -> dict:
    """Bytes of every form for the scaling table's ``method`` head (random weights, one AdamW step taken).

    Returns:
        ``{"trainable_params", "frozen_params", "forms": {form: {"bytes", "tar_bytes", "parts", "fits_return",
        "returns", "fits_carry"}}}``; bytes in bytes, parts of ``PART_BYTES``, returns: calls that return it.
    """
    from peagle_core.drafter import Eagle3Drafter
    from pipelines.train import build_optimizer, build_scheduler
    from pipelines.train.checkpoint import Checkpointer

    recipe = bench_recipe(RECIPE, train_overrides(method, []))
    cfg = recipe.drafter.to_drafter_config(TARGET_SHAPES["smollm2-135m"], method=method, target=recipe.target)
    drafter = Eagle3Drafter(cfg)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[: cfg.draft_vocab_size] = True
    drafter.set_vocab_mapping(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), t2d)
    drafter.embed_tokens.weight.requires_grad_(recipe.drafter.train_embed_tokens)
    opt = build_optimizer(drafter, recipe.training)
    for p in drafter.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    full = Checkpointer(drafter, opt, build_scheduler(opt, warmup_steps=1, total_steps=2)).save(
        work / method / "checkpoint_00000001", meta={"step": 1}, rank_state={"step": 1})
    out = {"trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
           "frozen_params": sum(p.numel() for p in drafter.parameters() if not p.requires_grad), "forms": {}}
    del drafter, opt
    for form in FORMS:
        d = compact_checkpoint(full, work / method / form / full.name, form)
        parts = return_tar(d, work / method / "parts" / f"{form}.tar")
        tar_bytes = sum(p.stat().st_size for p in parts)
        out["forms"][form] = {"bytes": form_bytes(d), "tar_bytes": tar_bytes, "parts": len(parts),
                              "fits_return": len(parts) <= RETURN_PARTS and tar_bytes <= RETURN_BYTES,
                              "returns": len(return_groups([p.stat().st_size for p in parts])),
                              "fits_carry": tar_bytes <= CARRY_BYTES}
        for p in [*parts, *(d.iterdir() if form != "full" else ())]:
            p.unlink()
    return out


# ---------------------------------------------------------------------------------------------- resume


def tiny_target(work: Path, seed: int):
    """The tiny random target (``TINY_TARGET``, ``lm_head`` x ``LM_HEAD_SCALE``) saved under ``work/target``;
    returns ``(model, config dict)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_TARGET)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(work / "target", safe_serialization=True)
    return model, model.config.to_dict()


def tiny_samples(model, layer_ids, *, num: int, prompt_tokens: int, new_tokens: int, seed: int) -> list[dict]:
    """``num`` captured samples (``pipelines.capture.capture_tokenized``, float32) of the target's own text:
    random prompts (no loss) and continuations it samples (temperature 1; the mask token suppressed)."""
    from pipelines.capture import capture_tokenized
    from pipelines.recipe import CaptureConfig

    prompts = torch.randint(0, MASK_ID, (num, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    with torch.no_grad():
        ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, suppress_tokens=[MASK_ID],
                             pad_token_id=MASK_ID, eos_token_id=None)
    mask = torch.zeros(ids.shape, dtype=torch.uint8)
    mask[:, prompt_tokens:] = 1
    rows = [{"sample_id": f"s{i}", "input_ids": ids[i].to(torch.int32).numpy(), "loss_mask": mask[i].numpy()}
            for i in range(num)]
    return capture_tokenized(model, rows, CaptureConfig(dtype="float32", batch_size=64), layer_ids, validate=False)


class TinyRun:
    """One method's head on the tiny target: the plan (scaling recipe's ``training`` and ``drafter`` sections at
    CPU sizes), the captured samples, and :meth:`train` through ``pipelines.train.train_in_process``."""

    def __init__(self, method: str, target, hf_config: dict, target_dir: Path, args) -> None:
        from peagle_core.vocab import vocab_mapping_from_counts
        from pipelines.capture import count_assistant_tokens
        from pipelines.train import TrainPlan

        recipe = bench_recipe(RECIPE, train_overrides(method, []))
        self.training = recipe.training.model_copy(update={
            "max_steps": args.steps, "warmup_steps": args.warmup_steps, "batch_tokens": args.batch_tokens,
            "checkpoint_every_steps": args.steps // 2})
        spec = recipe.drafter.model_copy(update={"draft_vocab_size": DRAFT_VOCAB, "mask_token_id": MASK_ID,
                                                 "num_speculative_tokens": args.num_speculative_tokens})
        dcfg = spec.to_drafter_config(hf_config, method=method)
        self.samples = tiny_samples(target, dcfg.aux_layer_ids, num=args.num_samples, prompt_tokens=8,
                                    new_tokens=args.new_tokens, seed=1)
        d2t, t2d = vocab_mapping_from_counts(count_assistant_tokens(self.samples, dcfg.vocab_size), DRAFT_VOCAB)
        self.plan = TrainPlan(training=self.training, drafter_spec=spec, drafter=dcfg, target_dir=target_dir,
                              objective=self.training.objective_config(spec.num_speculative_tokens),
                              target_name="tiny", d2t=d2t, t2d=t2d, total_steps=args.steps)

    def samples_for_epoch(self, epoch: int) -> list[dict]:
        """A seeded permutation per epoch (a sequence: a resume enters it at its position)."""
        perm = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(epoch)).tolist()
        return [self.samples[i] for i in perm]

    def train(self, checkpoint_dir: Path, *, stop_at_checkpoint: int | None = None,
              stop_after: int | None = None) -> dict[int, float]:
        """Train (resuming from the latest checkpoint under ``checkpoint_dir`` if any) with a drafter built as
        the train stage builds it; stop right after the checkpoint of ``stop_at_checkpoint`` or after step
        ``stop_after``. Returns ``{step: loss}`` of the steps this call trained."""
        from peagle_core.objectives import objective_class
        from pipelines.train import TrainCallback, build_drafter, train_in_process

        losses: dict[int, float] = {}

        def on_log(step: int, m: dict) -> None:
            losses[step] = float(m["loss"])
            if stop_after is not None and step >= stop_after:
                raise _Stop(step)

        class StopAt(TrainCallback):
            def on_checkpoint(self, step: int, metrics: dict) -> None:
                if stop_at_checkpoint is not None and step >= stop_at_checkpoint:
                    raise _Stop(step)

        torch.manual_seed(self.training.seed)  # the worker's init seed (bench.harness.build_head)
        drafter, lm_head = build_drafter(self.plan)
        try:
            train_in_process(self.samples_for_epoch, drafter, lm_head,
                             objective_class(self.training.method)(self.plan.objective), self.training,
                             checkpoint_dir=checkpoint_dir, device="cpu", log_every_steps=1, on_log=on_log,
                             callbacks=[StopAt()])
        except _Stop:
            pass
        return losses


def curve_noise(losses: list[float]) -> float:
    """Per-step noise of a loss curve: the std of each loss minus the centred ``SMOOTH_STEPS`` moving average
    (``losses`` includes ``SMOOTH_STEPS // 2`` steps either side of the window it measures)."""
    h = SMOOTH_STEPS // 2
    return statistics.pstdev([losses[i] - statistics.fmean(losses[i - h:i + h + 1])
                              for i in range(h, len(losses) - h)])


def measure_method(method: str, target, hf_config: dict, work: Path, args) -> dict:
    """Post-resume loss of every form against the uninterrupted run for ``method`` (see the module doc)."""
    run = TinyRun(method, target, hf_config, work / "target", args)
    half, end, h = args.steps // 2, args.steps // 2 + args.window, SMOOTH_STEPS // 2
    full = run.train(work / method / "uninterrupted", stop_after=end + h)
    run.train(work / method / "stopped", stop_at_checkpoint=half)
    steps = range(half + 1, end + 1)
    noise = curve_noise([full[s] for s in range(half + 1 - h, end + 1 + h)])
    threshold = noise / math.sqrt(MATCH_STEPS)
    forms = {}
    for form in args.forms:
        tmp = work / method / form
        return_checkpoint(work / method / "stopped", tmp / "out", "tiny", form)
        restore_checkpoint([tmp / "out"], tmp / "keep", "tiny")
        got = run.train(tmp / "keep" / "ckpt-tiny", stop_after=end)
        diff = [got[s] - full[s] for s in steps]
        forms[form] = {"max_abs_diff": max(abs(d) for d in diff), "mean_diff": statistics.fmean(diff),
                       "mean_diff_first_10": statistics.fmean(diff[:10]),
                       "matches": max(abs(d) for d in diff) < threshold, "loss": [round(got[s], 5) for s in steps]}
        print(f"{method} {form}: max |diff| {forms[form]['max_abs_diff']:.4f}, mean {forms[form]['mean_diff']:+.4f} "
              f"(threshold {threshold:.4f})", flush=True)
    return {"resume_step": half, "window_steps": [steps[0], steps[-1]], "loss_at_resume": full[half],
            "loss_at_step_1": full[1], "noise": noise,
            "threshold": threshold, "uninterrupted_loss": [round(full[s], 5) for s in steps],
            "forms": forms}


def choose_form(resume: dict, sizes: dict) -> str | None:
    """Of the forms that match for every method, the one that the fewest calls return for the largest head,
    then the smallest (largest head's returned bytes); None if no form matches."""
    ok = [f for f in FORMS if all(r["forms"][f]["matches"] for r in resume.values())]
    return min(ok, key=lambda f: (max(s["forms"][f]["returns"] for s in sizes.values()),
                                  max(s["forms"][f]["tar_bytes"] for s in sizes.values()))) if ok else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=sorted(LAYERS), choices=sorted(LAYERS))
    ap.add_argument("--steps", type=int, default=240, help="cosine horizon; the run stops at steps // 2")
    ap.add_argument("--window", type=int, default=40, help="steps compared after the resume")
    ap.add_argument("--warmup-steps", type=int, default=12)
    ap.add_argument("--batch-tokens", type=int, default=384)
    ap.add_argument("--num-samples", type=int, default=192, help="sequences the tiny target writes")
    ap.add_argument("--new-tokens", type=int, default=56, help="tokens per sequence after its 8-token prompt")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="P-EAGLE's K at CPU size")
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    ap.add_argument("--out-dir", type=Path, default=None, help="default bench/results")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sizes = {m: head_sizes(m, work / "sizes") for m in sorted(LAYERS)}
        target, hf_config = tiny_target(work, seed=0)
        resume = {m: measure_method(m, target, hf_config, work, args) for m in args.methods}
    chosen = choose_form(resume, sizes)
    payload = {"benchmark": RESULT, "forms": {f: FORMS[f].description for f in FORMS},
               "sizes": sizes, "resume": resume, "chosen_form": chosen, "default_form_in_code": DEFAULT_FORM,
               "limits": {"part_bytes": PART_BYTES, "return_parts": RETURN_PARTS, "return_bytes": RETURN_BYTES,
                          "carry_bytes": CARRY_BYTES},
               "setup": {k: v for k, v in vars(args).items() if k != "out_dir"} | {
                   "tiny_target": TINY_TARGET, "lm_head_scale": LM_HEAD_SCALE, "draft_vocab_size": DRAFT_VOCAB,
                   "smooth_steps": SMOOTH_STEPS, "match_steps": MATCH_STEPS, "recipe": str(RECIPE.name), "overrides": "bench.scale_train."
                   "TRAIN_OVERRIDES + max_steps, warmup_steps, batch_tokens, checkpoint_every_steps above"}}
    path = write_result(RESULT, payload, args.out_dir)
    print(f"chosen form {chosen} (bench.scale_train.DEFAULT_FORM = {DEFAULT_FORM}) -> {path}")


if __name__ == "__main__":
    main()
