"""Replay the regenerate stage's engine batches from their parts: how many sequences an engine ran at a time, and
what ordering the conversations would give.

A part (:mod:`pipelines.data.parts`) is one engine batch as the stage ran it: its conversations and the seconds its
engine spent generating them. Each conversation is a chain of turns (turn t+1 queued when turn t finishes,
``pipelines.data.regenerate._chained``). This replays a batch the way vLLM's continuous batching runs it: every
step, each running sequence makes one token, at most ``regenerate.max_num_seqs`` run, and a finished turn's next
turn joins the queue. A turn's length is its answer's tokens (SmolLM2 tokenizer), scaled so a conversation's
turns add up to its recorded ``num_generated_tokens``. Prefill is not modelled.

From the replayed steps and the measured ``generate_s`` of every part, a least-squares fit gives the engine's
step time as ``a + b x sequences running``; the same replay of the batches that
:func:`pipelines.data.regenerate.longest_chains_first` and :func:`pipelines.data.engine_pool.pool_chunks`
cut from the same conversations then predicts their tokens/s (and, to tell the two apart, the same blocks in the
parts' order). A model, not a measurement: the next lease measures.

    python -m bench.regen_batch_replay --parts RUN/regenerate/parts-KEY --tokenizer TARGET_DIR \\
        --config configs/smollm2-135m-300k.yaml --measured-on "..."   # -> bench/results/regen_batch_replay.json
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from pathlib import Path

from bench.common import write_result
from pipelines.data.engine_pool import pool_chunks
from pipelines.data.parts import PART_GLOB
from pipelines.data.regenerate import longest_chains_first
from pipelines.recipe import load_recipe


def turn_tokens(rows: list[dict], tokenizer) -> list[list[int]]:
    """Each row's answer lengths in tokens, one a regenerated turn, scaled to its ``num_generated_tokens``."""
    out = []
    for r in rows:
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        lens = [len(e.ids) for e in tokenizer.encode_batch(answers)] if answers else []
        total = sum(lens)
        out.append([max(1, round(n * r["num_generated_tokens"] / total)) for n in lens] if total else [])
    return out


def replay(chains: list[list[int]], max_num_seqs: int) -> tuple[int, int]:
    """(decode steps, tokens) of one engine batch of turn chains under continuous batching (module doc)."""
    queue = deque((i, 0) for i, c in enumerate(chains) if c)
    running: dict[tuple[int, int], int] = {}  # (chain, turn) -> tokens left
    steps = tokens = 0
    while queue or running:
        while queue and len(running) < max_num_seqs:
            i, t = queue.popleft()
            running[(i, t)] = chains[i][t]
        n = min(running.values())  # steps until the next turn finishes
        steps, tokens = steps + n, tokens + n * len(running)
        for (i, t), left in list(running.items()):
            if left == n:
                del running[(i, t)]
                if t + 1 < len(chains[i]):
                    queue.append((i, t + 1))
            else:
                running[(i, t)] = left - n
    return steps, tokens


def fit_step_ms(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``ms = a + b x`` over (sequences running, ms a step); returns (a, b)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", required=True, help="a regenerate parts directory (parts-<key>)")
    ap.add_argument("--tokenizer", required=True, help="the target's directory (tokenizer.json)")
    ap.add_argument("--config", default="configs/smollm2-135m-300k.yaml", help="the recipe that wrote the parts")
    ap.add_argument("--engines", type=int, default=4, help="engines of the run (pool_batches)")
    ap.add_argument("--measured-on", required=True, help="where the parts were generated, e.g. '2x NVIDIA H200, "
                    "2026-11-30, vLLM 0.26.0, 4 engines (2 a GPU)'")
    ap.add_argument("--name", default="regen_batch_replay")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    cfg = load_recipe(args.config).regenerate
    tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    parts, rows, chains = [], [], []
    for path in sorted(Path(args.parts).glob(PART_GLOB)):
        part = json.loads(path.read_text())
        c = turn_tokens(part["rows"], tok)
        steps, tokens = replay(c, cfg.max_num_seqs)
        parts.append({"conversations": len(c), "tokens": tokens, "steps": steps, "running": tokens / steps,
                      "generate_s": part["stats"]["generate_s"], "max_turns": max(map(len, c), default=0),
                      "tokens_per_s": part["stats"]["num_generated_tokens"] / part["stats"]["generate_s"]})
        rows += part["rows"]
        chains += c
    a, b = fit_step_ms([(p["running"], 1000 * p["generate_s"] / p["steps"]) for p in parts])
    chain_of = {r["id"]: c for r, c in zip(rows, chains)}
    def policy(ordered: list[dict]) -> dict:
        steps = tokens = 0
        for batch in pool_chunks(ordered, cfg.batch_size, args.engines):  # the stage's engine batches
            s, t = replay([chain_of[r["id"]] for r in batch], cfg.max_num_seqs)
            steps, tokens = steps + s, tokens + t
        running = tokens / steps
        return {"steps": steps, "running": running, "predicted_tokens_per_s": 1000 * running / (a + b * running)}

    steps, tokens = sum(p["steps"] for p in parts), sum(p["tokens"] for p in parts)
    as_run = {"steps": steps, "running": tokens / steps,
              "measured_tokens_per_s": tokens / sum(p["generate_s"] for p in parts)}
    out = write_result(args.name, {
        "benchmark": "regen_batch_replay", "measured_on": args.measured_on, "parts": Path(args.parts).name,
        "config": args.config, "batch_sizes_as_run": sorted({p["conversations"] for p in parts}),
        "max_num_seqs": cfg.max_num_seqs, "conversations": len(rows),
        "batch_size": max(map(len, pool_chunks(rows, cfg.batch_size, args.engines))),
        "tokens": tokens, "step_ms": {"a": a, "b_per_sequence": b}, "as_run": as_run,
        "whole_batches": policy(rows), "longest_chains_first": policy(longest_chains_first(rows, cfg)),
        "per_part": parts})
    print(out)


if __name__ == "__main__":
    main()
