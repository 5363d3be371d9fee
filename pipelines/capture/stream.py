"""Streaming capture (:func:`capture_stream`): a lazy Ray Dataset of captured rows that the trainer
consumes directly; nothing is written to disk (the target forward runs again each epoch)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from peagle_core.samples import dtype_name
from pipelines.assets import resolve_target
from pipelines.capture.actors import CaptureActor, actor_num_gpus, tokenize_num_cpus
from pipelines.capture.rows import conversation_rows
from pipelines.capture.target import check_backend
from pipelines.capture.tokenize import tokenize_conversations

if TYPE_CHECKING:
    import ray.data

    from pipelines.recipe import CaptureConfig, DataConfig, TargetConfig

log = logging.getLogger(__name__)


def _to_ray_dataset(conversations) -> ray.data.Dataset:
    """A Ray Dataset as it is; anything else through :func:`~pipelines.capture.rows.conversation_rows`."""
    import ray

    if hasattr(conversations, "map_batches") and hasattr(conversations, "take_all"):
        return conversations
    rows = conversation_rows(conversations)
    return ray.data.from_items(rows)


def capture_stream(
    conversations_ds,
    target_cfg: TargetConfig,
    capture_cfg: CaptureConfig,
    data_cfg: DataConfig,
    *,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: float | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
) -> ray.data.Dataset:
    """Streaming capture: a lazy Ray Dataset of captured rows (``sample_id, input_ids, loss_mask, aux,
    final_hidden``; variable-shaped tensors, hidden states in ``capture.dtype``, bf16 carried as
    float32) that the trainer consumes directly; nothing is written to disk.

    Two stages: ``tokenize_conversations`` (CPU tasks) then ``CaptureActor``
    (``capture.num_workers`` actors, ``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker`` GPUs
    each; None = 1 if the Ray cluster has GPUs, else 0). ``conversations_ds``: a Ray Dataset of
    ``{id, messages}`` rows (or anything ``run_capture`` accepts). Drop/truncate counts are
    logged by the tokenize tasks, not returned. A capture actor that dies is restarted and its batch
    retried by Ray Data (its actor-pool defaults; see ``pipelines.capture.materialize``).
    ``engine_kwargs``: added to each actor's ``vllm.LLM`` (``capture.backend: vllm``), as in ``run_capture``.

    Raises:
        ValueError: bad config (backend, dtype), or an unknown target (before any actor starts).
    """
    import ray

    check_backend(capture_cfg)
    dtype_name(capture_cfg.dtype)  # a bad dtype fails before any actor starts
    if capture_cfg.dtype == "bfloat16":
        log.warning("capture.dtype=bfloat16: streamed rows carry it as float32 (exact; numpy/Arrow have no bf16)")
    asset, config = resolve_target(target_cfg)
    layer_ids = target_cfg.resolve_aux_layer_ids(config["num_hidden_layers"])
    ds = _to_ray_dataset(conversations_ds)
    num_gpus = actor_num_gpus(num_gpus_per_worker)
    tokenized = ds.map_batches(
        tokenize_conversations,
        fn_kwargs={"tokenizer_path": str(asset.path), "max_length_tokens": data_cfg.max_length_tokens,
                   "on_too_long": capture_cfg.on_too_long},
        batch_size=capture_cfg.batch_size,
        batch_format="pyarrow",
        num_cpus=tokenize_num_cpus(num_gpus, num_cpus_per_worker, capture_cfg.num_workers),
    )
    return tokenized.map_batches(
        CaptureActor,
        fn_constructor_args=(str(asset.path), target_cfg.dtype, capture_cfg, layer_ids, data_cfg.max_length_tokens),
        fn_constructor_kwargs={"num_threads": max(1, int(num_cpus_per_worker)),
                               "engine_kwargs": dict(engine_kwargs or {})},
        compute=ray.data.ActorPoolStrategy(size=capture_cfg.num_workers),
        batch_size=capture_cfg.batch_size,
        batch_format="pyarrow",
        num_cpus=num_cpus_per_worker,
        num_gpus=num_gpus,
    )
