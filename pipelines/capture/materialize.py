"""Materialized capture: conversations -> resumable, checksummed shards on disk (:func:`run_capture`).

Shard k holds conversations ``[k*S, (k+1)*S)`` of the input order (``S =
capture.shard_size_samples``), so the assignment is deterministic. One Ray Data row = one shard task;
:func:`~pipelines.capture.tokenize.tokenize_shard_tasks` tokenizes it, a
:class:`~pipelines.capture.actors.CaptureShardActor` pool captures it and writes the shard atomically
(hidden states never travel through the object store). A re-run keeps every shard whose file is
complete, verified and made for the same conversations and settings, rewrites the others, and writes
``capture_meta.json`` then ``manifest.parquet`` last: the manifest exists only for a finished capture.

Faults: a capture actor that dies (a crash, a killed process) is restarted by Ray Data and its shard
task retried (Ray Data's actor-pool defaults, ``max_restarts=-1``, ``max_task_retries=-1``: unbounded;
they are not set here because the tokenize stage fuses into the actor on CPU only while both stages
have the same remote arguments); the run then finishes by itself. If the run fails anyway, a re-run
resumes from the shards on disk. A shard is written to a temporary file and renamed, so a writer killed
mid-shard leaves at most a temporary file, removed at the start and at the end of a run: no partial
shard is kept, no sample is written twice.

Shape legend: V target vocab.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_core import shards
from peagle_core.samples import INPUT_IDS, LOSS_MASK
from peagle_core.storage import bytes_per_token, format_bytes
from peagle_core.vocab import TOKEN_COUNTS_NAME, save_token_counts
from pipelines.assets import resolve_target
from pipelines.capture.actors import CaptureShardActor, actor_num_gpus, tokenize_num_cpus
from pipelines.capture.rows import SAMPLE_ID, conversation_rows
from pipelines.capture.target import check_backend
from pipelines.capture.tokenize import DROP_REASONS, count_assistant_tokens, tokenize_shard_tasks
from pipelines.data.lengths import length_distribution
from pipelines.tally import tally

if TYPE_CHECKING:
    from pipelines.recipe import CaptureConfig, DataConfig, TargetConfig

log = logging.getLogger(__name__)


@dataclass
class CaptureResult:
    """Outcome of :func:`run_capture`. ``bytes_per_token`` is on-disk size / tokens;
    ``tokens_per_s`` = tokens captured in this run (reused shards excluded) / wall time of the actor
    pool including actor start-up (``meta["forward_tokens_per_s"]`` excludes it)."""

    out_dir: Path
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    num_shards: int
    num_shards_reused: int
    dropped: dict[str, int]
    num_truncated: int
    bytes_per_token: float
    seconds: float
    tokens_per_s: float
    meta: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_meta(cls, out_dir: Path, meta: dict[str, Any], *, num_shards: int, num_shards_reused: int,
                  seconds: float) -> CaptureResult:
        """The result of a capture whose ``capture_meta.json`` holds ``meta`` (counts, drops, bytes, tokens/s)."""
        return cls(out_dir=out_dir, num_samples=meta["num_samples"], num_tokens=meta["num_tokens"],
                   num_loss_tokens=meta["num_loss_tokens"], num_shards=num_shards, num_shards_reused=num_shards_reused,
                   dropped=meta["dropped"], num_truncated=meta["num_truncated"],
                   bytes_per_token=meta["bytes_per_token_on_disk"], seconds=seconds,
                   tokens_per_s=meta["capture_tokens_per_s_this_run"] or 0.0, meta=meta)


def run_capture(
    conversations,
    target_cfg: TargetConfig,
    capture_cfg: CaptureConfig,
    data_cfg: DataConfig,
    out_dir: str | Path,
    *,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: float | None = None,
    use_ray: bool | None = None,
    progress: Callable[[int], None] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    reuse_shards: bool = True,
) -> CaptureResult:
    """Materialized capture of ``conversations`` (``datasets.Dataset``, Ray Dataset or list of rows
    ``{id, messages, ...}``) into ``out_dir``. Resumable: see the module docstring.

    ``use_ray``: two Ray Data stages over shard tasks: ``tokenize_shard_tasks`` (CPU tasks), then a
    ``CaptureShardActor`` pool (``capture.num_workers`` actors with ``num_cpus_per_worker`` CPUs
    and ``num_gpus_per_worker`` GPUs each; None = 1 if the Ray cluster has GPUs, else 0); Ray starts
    locally if ``ray.init`` has not run. With False the same two stages run in-process (a GPU box
    without Ray). None = Ray when importable. ``progress(n)`` is called as ``n`` conversations are
    captured, batch by batch inside each shard (the actors report them: ``pipelines.tally``; shards kept
    from an earlier run count at the start). ``engine_kwargs``: added to each
    actor's ``vllm.LLM`` (``capture.backend: vllm``; the pipeline passes
    ``pipelines.stages.base.engine_settings(recipe).vllm_kwargs``), ignored by transformers.
    ``reuse_shards=False`` (the capture stage under ``--force``) writes every shard again, verified ones too.

    Writes ``shard-XXXXX.safetensors``, ``token_counts.safetensors`` ([V] counts of assistant tokens
    for d2t/t2d), ``capture_meta.json`` and, last, ``manifest.parquet``.

    Raises:
        ValueError: bad config, no chat template, no conversations, or ``out_dir`` holding a capture made
            with other settings (all before the target forward).
    """
    check_backend(capture_cfg)
    if use_ray is None:
        use_ray = importlib.util.find_spec("ray") is not None
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = conversation_rows(conversations)
    if not rows:
        raise ValueError("run_capture got no conversations; check data.sources / num_samples")
    asset, config = resolve_target(target_cfg)
    layer_ids = target_cfg.resolve_aux_layer_ids(config["num_hidden_layers"])
    fp = _fingerprint(asset, layer_ids, capture_cfg, data_cfg)
    tasks = _shard_tasks(rows, capture_cfg.shard_size_samples, out_dir)
    done, shard_stats = _reuse_shards(out_dir, tasks, fp, keep=reuse_shards)
    num_reused = len(done)
    pending = [k for k in range(len(tasks)) if k not in done]
    advance = progress or (lambda n: None)
    advance(sum(len(tasks[k]) for k in done))
    use_ray = use_ray and bool(pending)
    log.info("capture: %d shards, %d verified and kept, %d to write", len(tasks), num_reused, len(pending))

    t_run = time.perf_counter()
    actor_args = (str(asset.path), target_cfg.dtype, capture_cfg, layer_ids, data_cfg.max_length_tokens)
    actor_kwargs = {"out_dir": str(out_dir), "shard_metadata": {"fingerprint": fp},
                    "engine_kwargs": dict(engine_kwargs or {})}
    tokenize_kwargs = {"tokenizer_path": str(asset.path), "max_length_tokens": data_cfg.max_length_tokens,
                       "on_too_long": capture_cfg.on_too_long}
    # the actors report conversations as each batch of samples is captured (pipelines.tally)
    with tally(lambda counts: advance(counts.get("conversations", 0)), use_ray=use_ray) as reports:
        actor_kwargs["reports"] = reports
        if not pending:
            written: Iterator[Mapping[str, Any]] = iter(())
        elif use_ray:
            written = _capture_with_ray(tasks, pending, actor_args, actor_kwargs, tokenize_kwargs,
                                        capture_cfg.num_workers, num_cpus_per_worker=num_cpus_per_worker,
                                        num_gpus_per_worker=num_gpus_per_worker)
        else:  # the same two stages, in-process
            written = _capture_in_process(tasks, pending, actor_args, actor_kwargs, tokenize_kwargs)
        _collect(written, done, shard_stats)
    run_s = time.perf_counter() - t_run

    meta, disk = _finish(out_dir, tasks, done, shard_stats, pending, run_s, asset=asset, target_cfg=target_cfg,
                         capture_cfg=capture_cfg, layer_ids=layer_ids, config=config, fingerprint=fp)
    result = CaptureResult.from_meta(out_dir, meta, num_shards=len(tasks), num_shards_reused=num_reused,
                                     seconds=time.perf_counter() - t_start)
    log.info(
        "capture done: %d samples, %d tokens, %s on disk (%.0f B/token), %.0f tokens/s, dropped %s, truncated %d",
        result.num_samples, result.num_tokens, format_bytes(disk),
        result.bytes_per_token, result.tokens_per_s, result.dropped, result.num_truncated,
    )
    return result


def _collect(written: Iterator[Mapping[str, Any]], done: dict, shard_stats: dict) -> None:
    """Record each shard row the capture stage yields (``shard_index``, its sample ``rows`` and ``stats`` as JSON)
    in ``done`` / ``shard_stats`` by shard index and log it."""
    for row in written:
        k = int(row["shard_index"])
        done[k] = json.loads(row["rows"])
        shard_stats[k] = json.loads(row["stats"])
        log.info("captured %s (%d samples)", shards.shard_name(k), len(done[k]))


def _fingerprint(asset, layer_ids, capture_cfg: CaptureConfig, data_cfg: DataConfig) -> dict[str, Any]:
    """The settings a shard was captured with (stored in its header): a shard is reused only under the
    same. ``asset``: the target's ``TargetAsset`` (its tokenizer's chat template is part of the settings).

    Raises:
        ValueError: the target tokenizer has no chat template.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(asset.path))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"target tokenizer at {asset.path} has no chat_template")
    return {
        "target_sha256": asset.sha256,
        "aux_layer_ids": list(layer_ids),
        "dtype": capture_cfg.dtype,
        "max_length_tokens": data_cfg.max_length_tokens,
        "on_too_long": capture_cfg.on_too_long,
        "shard_size_samples": capture_cfg.shard_size_samples,
        "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
    }


def _shard_tasks(rows: list[dict[str, Any]], size: int, out_dir: Path) -> list[list[dict[str, Any]]]:
    """``rows`` cut into shard tasks of ``size`` conversations, in input order.

    Raises:
        ValueError: ``out_dir`` holds shards beyond this input's (an earlier, larger run: not ours to keep).
    """
    tasks = [rows[i:i + size] for i in range(0, len(rows), size)]
    for k in range(len(tasks), 10**5):
        extra = out_dir / shards.shard_name(k)
        if not extra.exists():
            break
        raise ValueError(f"{extra} is beyond the {len(tasks)} shards of this input; use a new out_dir")
    return tasks


def _reuse_shards(out_dir: Path, tasks: list[list[dict[str, Any]]], fingerprint: dict[str, Any], *,
                  keep: bool = True) -> tuple[dict[int, list[dict]], dict[int, dict]]:
    """``(manifest rows, stats)`` by shard index of the shards on disk that can be kept (none when not
    ``keep``: each is written again); then removes the manifest (a manifest marks a finished capture: not yet)
    and temp files of interrupted writes.

    Raises:
        ValueError: a shard made with other settings (see :func:`_reusable_shard`).
    """
    done: dict[int, list[dict]] = {}
    shard_stats: dict[int, dict] = {}
    for k, task in enumerate(tasks if keep else ()):
        path = out_dir / shards.shard_name(k)
        reused = _reusable_shard(path, fingerprint, [r[SAMPLE_ID] for r in task])
        if reused is not None:
            done[k] = reused
            shard_stats[k] = json.loads(shards.shard_header(path).get("stats", "{}"))
    (out_dir / shards.MANIFEST_NAME).unlink(missing_ok=True)
    _remove_partial_shards(out_dir)
    return done, shard_stats


def _remove_partial_shards(out_dir: Path) -> None:
    """Delete the temporary files of shard writes that never finished (a killed or crashed writer)."""
    for stray in out_dir.glob(".shard-*.tmp"):
        log.info("removing %s (an interrupted shard write)", stray.name)
        stray.unlink(missing_ok=True)


def _reusable_shard(path: Path, fingerprint: dict[str, Any], conversation_ids: list[str]) -> list[dict] | None:
    """Manifest rows of an existing shard if it is complete, verified and made for exactly these
    conversations and settings; None if absent or stale/corrupt (then it is rewritten).

    Raises:
        ValueError: the shard was made with other settings (another target, layers, dtype...):
            a different capture lives in this directory; nothing is overwritten.
    """
    if not path.exists():
        return None
    try:
        header = shards.shard_header(path)
        got = json.loads(header.get("fingerprint", "null"))
        if got != fingerprint:
            diff = {k: (got or {}).get(k) for k in fingerprint if (got or {}).get(k) != fingerprint[k]}
            raise ValueError(
                f"{path} was captured with other settings ({diff} vs {fingerprint}); use a new out_dir or "
                "delete the old capture"
            )
        if json.loads(header.get("conversation_ids", "[]")) != conversation_ids:
            log.warning("%s holds other conversations (input order changed); rewriting it", path.name)
            return None
        return shards.read_shard(path, verify=True).rows()
    except shards.ShardError as e:
        log.warning("rewriting %s: %s", path.name, e)
        return None


def _capture_in_process(tasks, pending: list[int], actor_args: tuple, actor_kwargs: dict[str, Any],
                        tokenize_kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The two stages without Ray, one shard task after another: one result row per shard written."""
    import pyarrow as pa

    worker = CaptureShardActor(*actor_args, **actor_kwargs)
    for k in pending:
        task = pa.table({"shard_index": [k], "conversations": [json.dumps(tasks[k])]})
        res = worker(tokenize_shard_tasks(task, **tokenize_kwargs))
        yield {key: v[0] for key, v in res.items()}


def _capture_with_ray(tasks, pending: list[int], actor_args: tuple, actor_kwargs: dict[str, Any],
                      tokenize_kwargs: dict[str, Any], num_workers: int, *, num_cpus_per_worker: float,
                      num_gpus_per_worker: float | None) -> Iterator[dict[str, Any]]:
    """The two stages as Ray Data ``map_batches`` (CPU tokenize tasks, then a ``CaptureShardActor``
    pool of at most ``num_workers``): one result row per shard written, in completion order."""
    import ray

    num_workers = max(1, min(num_workers, len(pending)))
    ds = ray.data.from_items(
        [{"shard_index": k, "conversations": json.dumps(tasks[k])} for k in pending],
        override_num_blocks=len(pending),
    )
    num_gpus = actor_num_gpus(num_gpus_per_worker)
    tokenized = ds.map_batches(tokenize_shard_tasks, fn_kwargs=tokenize_kwargs, batch_size=1,
                               batch_format="pyarrow",
                               num_cpus=tokenize_num_cpus(num_gpus, num_cpus_per_worker, num_workers))
    # GPU actors are threaded: one shard is written while the next is captured (the actor's lock keeps one forward).
    # CPU actors are not: their tokenize stage is fused into them (tokenize_num_cpus), which needs equal remote args,
    # and the forward, not the write, bounds them there
    compute, remote_args = _actor_pool(num_workers, CaptureShardActor.SHARDS_IN_FLIGHT if num_gpus else 1)
    out = tokenized.map_batches(
        CaptureShardActor,
        fn_constructor_args=actor_args,
        fn_constructor_kwargs={**actor_kwargs, "num_threads": max(1, int(num_cpus_per_worker))},
        compute=compute,
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=num_cpus_per_worker,
        num_gpus=num_gpus,
        **remote_args,
    )
    yield from out.iter_rows()


def _actor_pool(size: int, calls_per_actor: int):
    """``(compute, ray_remote_args)`` for a ``map_batches`` pool of ``size`` actors, each running up to
    ``calls_per_actor`` calls at once in threads (1: one call at a time). Ray >= 2.59 takes the count in
    ``ActorPoolStrategy(max_concurrent_calls_per_actor=)`` and deprecates ``ray_remote_args``; Ray 2.58 (the GPU
    machines' carried Ray) only has the actor's ``max_concurrency`` remote argument."""
    import inspect

    import ray

    if calls_per_actor == 1:
        return ray.data.ActorPoolStrategy(size=size), {}
    if "max_concurrent_calls_per_actor" in inspect.signature(ray.data.ActorPoolStrategy).parameters:
        return ray.data.ActorPoolStrategy(size=size, max_concurrent_calls_per_actor=calls_per_actor,
                                          enable_true_multi_threading=True), {}
    return (ray.data.ActorPoolStrategy(size=size, enable_true_multi_threading=True),
            {"max_concurrency": calls_per_actor})


def capture_profile(shard_stats: Mapping[int, Mapping[str, Any]], pending: Sequence[int], run_s: float,
                    tokens: int) -> dict[str, Any]:
    """Where this run's capture time went, in seconds summed over the actors (each shard's ``*_ms`` from
    :meth:`~pipelines.capture.actors.CaptureShardActor.write_shard`): ``actor_start_s`` (model or engine
    load), ``wait_s`` (idle, waiting for tokenized shards), ``forward_s`` (model step with the copy to host),
    ``write_s`` (shard files); ``run_s`` is the wall time of the actor pool; ``num_actors`` the actors that
    wrote a shard. ``steady_tokens_per_s`` (:func:`steady_tokens_per_s`): the pool's rate once its actors
    started."""
    sums: Counter = Counter()
    for k in pending:
        sums.update({key: v for key, v in shard_stats[k].items() if key.endswith("_ms") and isinstance(v, int)})
    num_actors = sum(1 for k in pending if "actor_start_ms" in shard_stats[k])
    out = {f"{key[:-3]}_s": round(v / 1000, 3) for key, v in sorted(sums.items())}
    out |= {"run_s": round(run_s, 3), "num_actors": num_actors}
    return out | {"steady_tokens_per_s": steady_tokens_per_s(out, tokens)}


def steady_tokens_per_s(profile: Mapping[str, Any], tokens: int) -> float | None:
    """Capture's rate once its actors started: ``tokens`` / (``run_s`` - the mean ``actor_start_s`` per actor), from a
    :func:`capture_profile` (None without a start or a run). A shard's write may overlap the next one's forward
    (:class:`~pipelines.capture.actors.CaptureShardActor`), so forward and write seconds do not add up to it."""
    actors, run_s = profile.get("num_actors") or 0, profile.get("run_s") or 0.0
    steady_s = run_s - (profile.get("actor_start_s") or 0.0) / max(1, actors)
    return tokens / steady_s if actors and steady_s > 0 else None


def _shard_tokens(out_dir: Path, manifest_rows: Sequence[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """``{input_ids, loss_mask}`` of each shard (all its samples concatenated), read lazily: only these
    two tensors of one shard are in memory at a time."""
    from safetensors import safe_open

    for name in dict.fromkeys(r["shard"] for r in manifest_rows):
        with safe_open(str(out_dir / name), framework="pt") as f:
            yield {INPUT_IDS: f.get_tensor(INPUT_IDS), LOSS_MASK: f.get_tensor(LOSS_MASK)}


def _finish(out_dir: Path, tasks, done: dict[int, list[dict]], shard_stats: dict[int, dict], pending: list[int],
            run_s: float, *, asset, target_cfg: TargetConfig, capture_cfg: CaptureConfig, layer_ids,
            config: dict[str, Any], fingerprint: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Write ``token_counts.safetensors``, ``capture_meta.json`` and, last, the manifest of a capture
    whose shards are all on disk; returns the meta (sizes, drops, throughput of this run) and the
    shards' bytes on disk."""
    _remove_partial_shards(out_dir)  # left by an actor killed mid-write and retried in this run
    manifest_rows = [r for k in range(len(tasks)) for r in done[k]]
    totals: Counter = Counter()
    for s in shard_stats.values():
        totals.update({k: v for k, v in s.items() if isinstance(v, int)})
    new_tokens = sum(shard_stats[k].get("num_tokens", 0) for k in pending)
    profile = capture_profile(shard_stats, pending, run_s, new_tokens)
    forward_s = profile.get("forward_s", 0.0)
    num_tokens = sum(r["length"] for r in manifest_rows)
    disk = sum((out_dir / shards.shard_name(k)).stat().st_size for k in range(len(tasks)))
    hidden_size, vocab_size = int(config["hidden_size"]), int(config["vocab_size"])
    counts = count_assistant_tokens(_shard_tokens(out_dir, manifest_rows), vocab_size)
    save_token_counts(out_dir / TOKEN_COUNTS_NAME, counts,
                      {"target_sha256": asset.sha256, "num_tokens": int(counts.sum())})
    meta = {
        "target_path": str(asset.path),
        "target_sha256": asset.sha256,
        "target_model": target_cfg.model,
        "target_dtype": target_cfg.dtype,
        "backend": capture_cfg.backend,
        "aux_layer_ids": list(layer_ids),
        "aux_layer_semantics": "vLLM: input of decoder layer i = HF hidden_states[i]",
        "dtype": capture_cfg.dtype,
        "hidden_size": hidden_size,
        "aux_width": len(layer_ids) * hidden_size,
        "vocab_size": vocab_size,
        "final_hidden": "after the target's final norm: target logits = lm_head(final_hidden)",
        "bytes_per_token": bytes_per_token(hidden_size, capture_cfg.dtype, len(layer_ids)),
        "bytes_per_token_on_disk": disk / max(num_tokens, 1),
        "num_conversations": sum(len(t) for t in tasks),
        "num_samples": len(manifest_rows),
        "num_tokens": num_tokens,
        "num_loss_tokens": int(totals.get("num_loss_tokens", 0)),
        "num_shards": len(tasks),
        "num_truncated": int(totals.get("truncated", 0)),
        "dropped": {r: totals.get(f"dropped_{r}", 0) for r in DROP_REASONS},
        "fingerprint": fingerprint,
        "capture_tokens_per_s_this_run": new_tokens / run_s if pending and run_s > 0 else None,
        # tokens / time in the model step (batching, forward, copy to host, validate), summed over actors
        "forward_tokens_per_s": new_tokens / forward_s if forward_s > 0 else None,
        "profile": profile,
        "length_distribution": length_distribution([r["length"] for r in manifest_rows]),
    }
    shards.write_capture_meta(out_dir, meta)
    shards.write_manifest(out_dir, manifest_rows)  # last: marks the capture finished
    return meta, disk
