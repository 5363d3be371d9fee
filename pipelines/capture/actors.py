"""Ray Data actors of capture (the model stage) and the resources of the two stages.

:class:`CaptureActor` holds the target (``capture.backend: transformers``) or a vLLM engine (``vllm``)
for the actor's life and turns tokenized rows into captured sample rows (streaming capture);
:class:`CaptureShardActor` captures one shard task per row and writes it to disk (materialized
capture). Both also run in-process, without Ray.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_core import shards
from pipelines.capture.forward import capture_tokenized, pad_id
from pipelines.capture.rows import (
    INPUT_IDS,
    LOSS_MASK,
    SAMPLE_ID,
    ragged_from_arrow,
    samples_to_columns,
    tokenized_from_batch,
)
from pipelines.capture.target import load_target
from pipelines.tally import Tally

if TYPE_CHECKING:
    from pipelines.recipe import CaptureConfig

log = logging.getLogger(__name__)


def actor_num_gpus(requested: float | None) -> float:
    """GPUs per engine actor (capture, and regenerate's actor pool): ``requested``, or 1 when the Ray cluster
    has GPUs, else 0 (CPU)."""
    if requested is not None:
        return float(requested)
    import ray

    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def tokenize_num_cpus(num_gpus: float, num_cpus_per_worker: float, num_workers: int) -> float:
    """CPUs per tokenize task. With GPU actors: 1, so Ray Data runs tokenize tasks on free CPUs in
    parallel with the GPU stage. Without: the actor's CPUs, so Ray Data fuses tokenization into the
    actor (same remote args): on CPU the forward is the bottleneck, and separate tokenize tasks
    could wait forever for CPUs held by the actor pool."""
    if not num_gpus:
        return num_cpus_per_worker
    import ray

    if ray.is_initialized():
        free = ray.cluster_resources().get("CPU", 0) - num_workers * num_cpus_per_worker
        if free < 1:
            log.warning("capture: %d GPU actors x %s CPUs leave %s CPUs for the tokenize stage; it needs >= 1 "
                        "(lower num_cpus_per_worker or add CPUs, else the pipeline waits for CPUs)",
                        num_workers, num_cpus_per_worker, free)
    return 1.0


class CaptureActor:
    """Ray Data ``map_batches`` actor, the model stage: tokenized rows (``sample_id``, ``input_ids``,
    ``loss_mask``, from the :func:`~pipelines.capture.tokenize.tokenize_conversations` stage) ->
    captured sample rows.

    Use: ``ds.map_batches(tokenize_conversations, ...).map_batches(CaptureActor, fn_constructor_kwargs=
    dict(...), compute=ray.data.ActorPoolStrategy(size=n), num_gpus=1, batch_size=capture.batch_size,
    batch_format="pyarrow")``. Holds its engine for the actor's life (created once): for
    ``capture.backend: transformers`` the HF target (``num_threads`` torch threads: set it to the
    actor's CPUs), for ``vllm`` a :class:`~pipelines.capture.vllm_backend.VLLMCaptureEngine`
    (``engine_kwargs`` go to ``vllm.LLM``; all rows of a call go into one ``generate``; vLLM picks
    its own CPU threads, ``num_threads`` is not used).

    Raises:
        ValueError: ``vllm`` without ``max_length_tokens``, or engine arguments it cannot run with
            (from :class:`~pipelines.capture.vllm_backend.VLLMCaptureEngine`); no chat template (transformers).
    """

    def __init__(self, target_path: str, target_dtype: str, capture_cfg: CaptureConfig, layer_ids: Sequence[int],
                 max_length_tokens: int | None, num_threads: int | None = None,
                 engine_kwargs: Mapping[str, Any] | None = None):
        self.cfg, self.layer_ids, self.max_length_tokens = capture_cfg, tuple(layer_ids), max_length_tokens
        self.stats: Counter = Counter()
        self.model = self.tokenizer = self.engine = None
        if capture_cfg.backend == "vllm":
            from pipelines.capture.vllm_backend import VLLMCaptureEngine

            if max_length_tokens is None:
                raise ValueError("capture.backend=vllm needs data.max_length_tokens (the engine's context)")
            self.engine = VLLMCaptureEngine(target_path, target_dtype, self.layer_ids, capture_cfg.dtype,
                                            max_length_tokens=max_length_tokens, **dict(engine_kwargs or {}))
        else:
            self.model, self.tokenizer = load_target(target_path, target_dtype, num_threads=num_threads)

    def capture(self, tokenized: Sequence[Mapping[str, Any]], stats: Counter | None = None,
                progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        """Captured samples of ``tokenized``; ``progress(n)`` as ``n`` of them are done (transformers: per
        ``capture.batch_size`` batch; vllm: all at once, one ``generate``)."""
        stats = self.stats if stats is None else stats
        if self.engine is not None:
            from pipelines.capture.vllm_backend import capture_tokenized_vllm

            out = capture_tokenized_vllm(self.engine, tokenized, self.cfg, max_length_tokens=self.max_length_tokens,
                                         stats=stats)
            if progress is not None:
                progress(len(out))
            return out
        return capture_tokenized(self.model, tokenized, self.cfg, self.layer_ids, pad_token_id=pad_id(self.tokenizer),
                                 max_length_tokens=self.max_length_tokens, stats=stats, progress=progress)

    def __call__(self, batch) -> dict[str, Any]:
        return samples_to_columns(self.capture(tokenized_from_batch(batch)))


class CaptureShardActor(CaptureActor):
    """Materialized capture: each input row is one tokenized shard (from
    :func:`~pipelines.capture.tokenize.tokenize_shard_tasks`); captures it, writes
    ``shard-XXXXX.safetensors`` atomically (into ``out_dir``, with ``shard_metadata`` in its header),
    returns its manifest rows and counts. ``reports``: where it reports the conversations it is done with
    (``conversations=n``) as each batch of samples is captured, and the shard's dropped ones at its end.

    Thread-safe for :data:`SHARDS_IN_FLIGHT` concurrent calls (a threaded Ray actor): the model runs one shard at a
    time (a lock), and a shard's file is written outside it, so one shard is written while the next is captured.
    """

    # shards one actor holds at once: one in the model, one on its way to disk. The shard writes took 71% of the
    # actors' busy time on 2 H200s when each followed its forward (multi_gpu_capture_2.json)
    SHARDS_IN_FLIGHT = 2

    def __init__(self, *args, out_dir: str, shard_metadata: dict[str, Any], reports: Tally | None = None, **kwargs):
        t0 = time.perf_counter()
        super().__init__(*args, **kwargs)
        self.out_dir, self.shard_metadata = Path(out_dir), shard_metadata
        self.reports = reports or Tally()
        self._model = threading.Lock()  # one forward at a time: the GPU's memory holds one shard's batches
        self._ready = time.perf_counter()  # when the model last went idle: the actor's start, then each forward
        self._start_ms = round(1000 * (self._ready - t0))  # told once, with the actor's first shard

    def __call__(self, batch) -> dict[str, Any]:
        out: dict[str, list] = {"shard_index": [], "rows": [], "stats": []}
        for r in range(batch.num_rows):
            k, manifest_rows, stats = self.write_shard(batch, r)
            out["shard_index"].append(k)
            out["rows"].append(json.dumps(manifest_rows))
            out["stats"].append(json.dumps(dict(stats)))
        return out

    def write_shard(self, batch, r: int) -> tuple[int, list[dict[str, Any]], Counter]:
        """Capture row ``r`` of ``batch`` (one shard task) and write its shard: ``(shard index, manifest
        rows, stats)``, stats being the tokenize counts plus ``num_samples``, ``num_tokens``,
        ``num_loss_tokens`` and the shard's profile in milliseconds: ``forward_ms`` (the model step: batching,
        forward, copy to host), ``write_ms`` (the shard file, fsync included; it may overlap the next shard's
        forward), ``wait_ms`` (the model idle before this shard's forward, since the actor's start or its previous
        forward: waiting for tokenized input) and, on an actor's first shard, ``actor_start_ms`` (model or engine
        load)."""
        k = int(batch.column("shard_index")[r].as_py())
        tokenized = [{SAMPLE_ID: s, INPUT_IDS: i, LOSS_MASK: m} for s, i, m in zip(
            batch.column(SAMPLE_ID)[r].as_py(), ragged_from_arrow(batch.column(INPUT_IDS)[r].values),
            ragged_from_arrow(batch.column(LOSS_MASK)[r].values))]
        stats: Counter = Counter(json.loads(batch.column("tokenize_stats")[r].as_py()))
        conversation_ids = json.loads(batch.column("conversation_ids")[r].as_py())
        with self._model:
            t0 = time.perf_counter()
            stats["wait_ms"] = max(0, round(1000 * (t0 - self._ready)))
            if self._start_ms is not None:
                stats["actor_start_ms"], self._start_ms = self._start_ms, None
            samples = self.capture(tokenized, stats, progress=lambda n: self.reports.add(conversations=n))
            self._ready = t1 = time.perf_counter()
        stats["forward_ms"] = round(1000 * (t1 - t0))
        self.reports.add(conversations=len(conversation_ids) - len(samples))  # dropped by the tokenize stage
        meta = {**self.shard_metadata, "conversation_ids": conversation_ids, "stats": dict(stats)}
        path = self.out_dir / shards.shard_name(k)
        rows = shards.write_shard(path, samples, metadata=meta, validate=False)  # validated above
        stats["write_ms"] = round(1000 * (time.perf_counter() - t1))
        return k, rows, stats
