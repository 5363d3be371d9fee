"""Loss elements per depth in speculators' P-EAGLE and in peagle's (issue 26 items 3 and 5): how much of each
trainer's loss a training step puts on depth 0 (the slot with the real token) and on the mask-token depths.

speculators 0.9 (``speculators/models/peagle/data.py: generate_cod_sample_indices``) keeps every position of a
packed batch at depth 0 and draws the deeper depths from at most ``max_anchors`` (default 512) anchors of the
batch, then averages the loss uniformly over the kept loss-mask elements (``speculators/losses/utils.py``). peagle
keeps ``cod_ratio ** d`` (floor ``cod_min_ratio``) of every depth's anchors and also averages uniformly
(``peagle_core.objectives.peagle``). Here speculators' own sampler and COD function run on the training batches
of a data directory made by ``bench.speculators_side data`` (no GPU, no hidden states), beside the per-depth counts
of a peagle run's last training window (``bench/results/scale_train.json``):

    python -m bench.speculators_side data --keep outputs/keep99 --size 3000 --out /tmp/sd
    python -m bench.speculators_depths --data /tmp/sd --batches 100 --peagle peagle-99k-600s#2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.common import write_result
from bench.speculators_data import SIDE_FILE

NAME = "speculators_depths"
# speculators' defaults as bench.speculators_side runs them (its P-EAGLE group and train flags)
SPEC_DEFAULTS = {"num_depths": 8, "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2, "max_anchors": 512,
                 "total_seq_len": 16384, "train_data_ratio": 0.999}


def speculators_counts(data: str, batches: int, *, seed: int = 0) -> tuple[list[float], int]:
    """Mean loss-mask elements per depth and step over the first ``batches`` training batches of ``data``, as
    speculators' P-EAGLE forward samples them (its multipack sampler, its COD function); returns the means
    ``[num_depths]`` and the batches used."""
    from datasets import load_from_disk
    from speculators.models.peagle.data import generate_cod_sample_indices
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    s = SPEC_DEFAULTS
    ds = load_from_disk(data).with_format(None)
    train = ds.select(range(int(len(ds) * s["train_data_ratio"])))
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=s["total_seq_len"], lengths=list(train["seq_len"]),
                                                  num_replicas=1, rank=0, seed=seed)
    torch.manual_seed(seed)
    counts = np.zeros(s["num_depths"])
    used = 0
    for idx in sampler:
        if used == batches:
            break
        mask = torch.tensor(np.concatenate([np.asarray(train[int(i)]["loss_mask"]) for i in idx]))[None].float()
        anchor, depth = generate_cod_sample_indices(mask.shape[1], mask, num_depths=s["num_depths"],
                                                    down_sample_ratio=s["down_sample_ratio"],
                                                    down_sample_ratio_min=s["down_sample_ratio_min"],
                                                    max_anchors=s["max_anchors"])
        kept = mask[0, anchor + depth] > 0  # the loss mask of each element's target position, as its loss reads it
        counts += np.bincount(depth[kept].numpy(), minlength=s["num_depths"])
        used += 1
    return (counts / max(used, 1)).tolist(), used


def peagle_counts(ref: str) -> list[float]:
    """Per-depth loss elements per step of a ``bench.scale`` run's last training window (``TAG#RUN``).

    Raises:
        SystemExit: no such run in ``scale_train.json``."""
    from bench.report_scale import last_final, train_row

    tag, _, run = ref.partition("#")
    fin = last_final(train_row(tag, int(run or 1)))
    if not fin:
        raise SystemExit(f"{ref}: no run with a training window in bench/results/scale_train.json")
    return [fin[f"count_d{d}"] for d in range(16) if f"count_d{d}" in fin]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.speculators_depths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a directory made by `bench.speculators_side data`")
    ap.add_argument("--batches", type=int, default=100, help="training batches to sample")
    ap.add_argument("--peagle", default="peagle-99k-600s#2", help="the bench.scale run (TAG#RUN) to set beside")
    args = ap.parse_args()
    spec, used = speculators_counts(args.data, args.batches)
    pea = peagle_counts(args.peagle)
    rows = [{"trainer": "speculators 0.9.0", "settings": SPEC_DEFAULTS, "batches": used, "per_depth": spec},
            {"trainer": "peagle", "run": args.peagle, "per_depth": pea}]
    for r in rows:
        r["depth0_share"] = r["per_depth"][0] / sum(r["per_depth"])
    side = json.loads((Path(args.data) / SIDE_FILE).read_text())
    out = write_result(NAME, {"command": "python -m bench.speculators_depths " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items()), "conversations": side["num_conversations"], "rows": rows})
    print(out, json.dumps([{k: r[k] for k in ("trainer", "depth0_share")} for r in rows]))


if __name__ == "__main__":
    main()
