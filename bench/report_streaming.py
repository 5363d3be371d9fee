"""The section of ``docs/benchmarks.md`` on capture streamed into training (``capture.streaming``: the target's
forward runs in capture actors beside the Ray Train workers, no shards on disk) against the same machine's
materialized capture followed by training on the same workers: ``bench/device/run_multi_gpu.sh stage train
multi_gpu_train_<label>`` records whose train outputs say ``streaming``."""

from __future__ import annotations

from bench.common import RESULTS
from bench.report_fmt import f, job_sets, load, table
from bench.report_per_gpu import _batch_cell, _history, leases, stage_runs, train_tok_s

HEADING = "### Capture streamed into training against materialized capture (the same machine and conversations)"
GB = 1e9


def _streamed() -> list[tuple[str, dict]]:
    """``(result name, record)`` of every several-GPU train run that streamed its capture."""
    out = []
    for path in sorted(RESULTS.glob("multi_gpu_train_*.json")):
        r = load(path.stem)
        rec = (r or {}).get("stage_records", {}).get("train") or {}
        if rec.get("status") == "ran" and (rec.get("outputs") or {}).get("streaming"):
            out.append((path.stem, r))
    return out


def streaming(lines: list[str]) -> None:
    """One table per streamed run: it and the same machine's materialized run of as many train workers and tokens
    a step (its capture stage's seconds, rate and bytes from the train record's capture record), then their losses
    and a reading."""
    streamed = _streamed()
    lines += [HEADING, ""]
    if not streamed:
        lines += ["not run", ""]
        return
    machines = leases()
    runs = stage_runs("train")
    for name, r in streamed:
        machine = machines[name]
        stream = next(x for x in _as_runs(name, r, machine))
        mat = next((x for x in runs if x.machine == machine and _batch_cell(x) == _batch_cell(stream)), None)
        sets = job_sets(r)
        rows = [[f"`{name}.json`", f"streamed: {sets.get('capture.num_workers', '?')} capture actors inside training",
                 f"{stream.gpus} together", _batch_cell(stream), f(r['stage_records']['train']['seconds'], 1),
                 f"{train_tok_s(_history(stream)):,.0f}",
                 "0"]]
        if mat is not None:
            cap = mat.record["stage_records"]["capture"]
            co = cap["outputs"]
            rows.append([f"`{mat.name}.json`", (f"capture stage first: {cap['placement']['num_gpus']} GPUs, "
                         f"{co['tokens_per_s']:,.0f} tok/s"), f"{cap['placement']['num_gpus']}, then {mat.gpus}",
                         _batch_cell(mat), f"{cap['seconds']:.1f} + {mat.record['stage_records']['train']['seconds']:.1f}",
                         f"{train_tok_s(_history(mat)):,.0f}", f"{co['bytes_on_disk'] / GB:,.1f} GB"])
        lines += [(f"{machine}; the same conversations (the prompts' own answers, regenerate off), P-EAGLE, "
                  f"{int(_history(stream)[-1]['step'])} steps:"), ""]
        lines += table(["run", "capture", "GPUs", "workers x tokens a step", "seconds", "training tok/s",
                        "hidden states on disk"], rows) + [""]
        if mat is None:
            continue
        a = {int(h["step"]): h for h in _history(mat)}
        b = {int(h["step"]): h for h in _history(stream)}
        steps = sorted(a.keys() & b.keys())
        lines += table(["step", "loss, materialized", "loss, streamed"],
                       [[s, f(a[s]["loss"], 3), f(b[s]["loss"], 3)] for s in steps]) + [""]
        gap = max(abs(b[s]["loss"] / a[s]["loss"] - 1) for s in steps)
        ratio = train_tok_s(_history(stream)) / train_tok_s(_history(mat))
        lines += [(f"Reading: capture streamed from {sets.get('capture.num_workers', '?')} GPUs fed "
                   f"{_batch_cell(stream).split(' x ')[0]} DDP workers at {train_tok_s(_history(stream)):,.0f} "
                   f"training tok/s, {ratio:.2f}x the same workers reading the materialized shards, with nothing "
                   f"on disk where materialized capture wrote {co['bytes_on_disk'] / GB:,.1f} GB, and the losses "
                   f"agree within {gap:.1%} at every logged window (the batches differ: each path orders its "
                   "samples its own way)."
                   + (" The capture actors kept up: the streamed workers trained faster than the same workers "
                      "reading shards." if ratio >= 1 else " The trainers waited for the capture actors.")
                   + " The streamed stage's seconds include starting the target in its capture actors. At "
                   f"{co['bytes_per_token']:,.0f} bytes a token materialized, the 300k-conversation build "
                   "(configs/smollm2-135m-300k.yaml) streams."), ""]


def _as_runs(name: str, r: dict, machine: str):
    """The streamed record as a :class:`bench.report_per_gpu.StageRun` (its placement's GPUs: capture and train)."""
    from bench.report_per_gpu import StageRun

    rec = r["stage_records"]["train"]
    gpus = r.get("gpus") or [r["environment"]["device"]]
    yield StageRun(name, (rec.get("placement") or {}).get("num_gpus") or 1, gpus[0], machine, rec["outputs"], r)
