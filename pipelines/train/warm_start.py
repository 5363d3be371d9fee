"""Warm start (``training.init_from``): a run that begins from an existing head, e.g. the served champion,
instead of from the target's embeddings, and fine-tunes it on new data.

The steps, each before any training compute:

1. :func:`resolve_init_from` turns the recipe's reference into an :class:`InitHead`: a registry reference
   (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``) into the model version it points to *now* and that
   version's ``head_sha256`` tag (:class:`pipelines.registry.refs.HeadRef`, its one parser and resolver), a local head directory into
   the digest of its files (``peagle_core.contract.head_digest``). A bad reference raises ValueError
   here. The train stage does this once per pipeline run and keys on :meth:`InitHead.key` (the version
   and digest, not the alias: ``@champion`` means another head after each promotion).
2. :func:`fetch_init_head` downloads that pinned version (``NAME/VERSION``, not the alias, which may
   have moved since) through ``pipelines.registry.register.download`` (checksums verified, contract validated)
   and checks its digest against the tag.
3. The plan (``pipelines.train.plan``) checks the head against the drafter it will train
   (:func:`check_init_head`: ``peagle_core.warm_start.check_head_matches``: hidden size, layers, vocab and
   draft vocab, aux layer ids, method; every mismatch named) and takes the head's ``d2t``/``t2d``
   instead of counting tokens: the ``lm_head`` rows keep their meaning.
4. Every worker builds the drafter as usual (target embeddings and ``lm_head`` rows) and then loads the
   head over it (:func:`load_init_weights`: all layers, ``fc``, norms, ``lm_head``, ``mask_hidden``,
   ``embed_tokens`` when the head has them). The optimizer (AdamW moments), the LR schedule (warm-up and
   cosine over ``total_steps``) and the data position start fresh. A resumed run loads its own
   checkpoint over the head, as any resume does.

Shape legend: V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from peagle_core.contract import EMBED, WEIGHTS_FILE, HeadContractError, head_digest, verify_checksums
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig
from peagle_core.warm_start import check_head_matches, load_head_weights
from pipelines.registry.refs import PREFIX, HeadRef

log = logging.getLogger(__name__)

__all__ = ["InitHead", "check_init_head", "fetch_init_head", "load_init_weights", "local_head_path", "resolve_init_from"]


@dataclass(frozen=True, kw_only=True)
class InitHead:
    """A resolved ``training.init_from`` (picklable: it travels in the plan to every worker).

    Args:
        ref: the reference as the recipe writes it.
        head_sha256: sha256 of the head's ``peagle_checksums.json`` (the registry's ``head_sha256`` tag;
            None for a registry version without that tag).
        registry: the registered version ``ref`` resolved to (a pinned ``HeadRef``; None for a local head).
        head_dir: the local head directory (a local ``ref``, or once :func:`fetch_init_head` downloaded it).
    """

    ref: str
    head_sha256: str | None
    registry: HeadRef | None = None
    head_dir: str | None = None

    @classmethod
    def from_registry(cls, ref: str, pinned: HeadRef) -> InitHead:
        """The head of a registry reference ``ref`` (as written) resolved to ``pinned``."""
        return cls(ref=ref, head_sha256=pinned.head_sha256, registry=pinned)

    @property
    def model_name(self) -> str | None:
        return self.registry.name if self.registry is not None else None

    @property
    def version(self) -> str | None:
        return self.registry.version if self.registry is not None else None

    @property
    def pinned_ref(self) -> str:
        """``models:/NAME/VERSION`` (the version ``ref`` resolved to), or the local directory."""
        return str(self.registry) if self.registry is not None else str(self.head_dir)

    def key(self) -> dict[str, Any]:
        """What identifies the head in the train stage's key and the exported head's provenance: the model
        version and digest of a registry head, the digest of a local one (not its path)."""
        if self.registry is not None:
            return {"model": self.registry.name, "version": self.registry.version, "head_sha256": self.head_sha256}
        return {"head_sha256": self.head_sha256}

    def describe(self) -> str:
        """One line for progress messages: ``models:/NAME/3 (NAME@champion, sha256 1a2b3c4d5e6f)``."""
        sha = (self.head_sha256 or "untagged")[:12]
        if self.registry is not None:
            return f"{self.pinned_ref} ({self.ref.removeprefix(PREFIX)}, sha256 {sha})"
        return f"{self.head_dir} (sha256 {sha})"


def local_head_path(ref: str) -> Path:
    """A local ``init_from`` as a path (``~`` and ``$VARS`` expanded)."""
    return Path(os.path.expandvars(ref)).expanduser()


def resolve_init_from(ref: str, *, tracking_uri: str | None = None) -> InitHead:
    """Resolve ``training.init_from`` without downloading weights (step 1 of the module docstring).

    Args:
        ref: ``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, or a head directory.
        tracking_uri: the MLflow store of a registry ``ref`` (``pipelines.settings.tracking_uri`` rule).

    Raises:
        ValueError: naming ``ref``: a malformed registry reference, a model/alias/version the registry does
            not have, a local path that is not a directory, or a local head whose checksums fail.
        pipelines.registry.register.TrackingUnreachableError: an ``http(s)://`` tracking server that does not answer.
    """
    if HeadRef.is_ref(ref):
        from pipelines.registry.client import tracking_guard

        with tracking_guard(tracking_uri, hint=f"training.init_from={ref!r} needs the registry: start it, or point "
                            "init_from at a local head directory") as uri:
            pinned = HeadRef.parse(ref).resolve(uri, field="training.init_from", fix="register a head first (peagle "
                                                "registry list shows them) or fix the name/alias")
        return InitHead.from_registry(ref, pinned)
    path = local_head_path(ref)
    if not path.is_dir():
        raise ValueError(f"training.init_from={ref!r}: {path} is not a directory; give a head directory "
                         "(written by peagle_core.contract.export_head) or a registry reference "
                         "models:/NAME@ALIAS")
    try:
        verify_checksums(path)
        digest = head_digest(path)
    except HeadContractError as e:
        raise ValueError(f"training.init_from={ref!r}: {e}") from None
    return InitHead(ref=ref, head_sha256=digest, head_dir=str(path))


def fetch_init_head(init: InitHead, dst: str | os.PathLike, *, tracking_uri: str | None = None) -> InitHead:
    """Make a registry head local (step 2): download the pinned version into ``dst`` (kept when ``dst``
    already holds a head with the same digest) and check its digest against the version's tag.

    Returns:
        ``init`` with ``head_dir`` set (unchanged for a local head).

    Raises:
        ValueError: the downloaded head's digest differs from the version's ``head_sha256`` tag.
        peagle_core.contract.HeadContractError: the download fails its checksums or the contract.
    """
    if init.head_dir is not None:
        return init
    from pipelines.registry.register import download

    out = Path(dst)
    if init.head_sha256 and _digest_or_none(out) == init.head_sha256:
        log.info("warm-start head %s already in %s", init.pinned_ref, out)
    else:
        download(init.registry, out, tracking_uri=tracking_uri)
    got = head_digest(out)
    if init.head_sha256 and got != init.head_sha256:
        raise ValueError(f"training.init_from={init.ref!r}: {init.pinned_ref} downloaded with sha256 {got[:12]}… but "
                         f"the version is tagged {init.head_sha256[:12]}…: its files changed after registration")
    return replace(init, head_dir=str(out), head_sha256=init.head_sha256 or got)


def _digest_or_none(head_dir: Path) -> str | None:
    try:
        verify_checksums(head_dir)
        return head_digest(head_dir)
    except (HeadContractError, OSError):
        return None


def check_init_head(init: InitHead, drafter: DrafterConfig, *,
                    target_sha256: str | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Check the head against the drafter the plan trains (step 3) and return its vocabulary mapping.

    Returns:
        ``(d2t [Vd] int64, t2d [V] bool)`` of a pruned draft vocabulary, ``(None, None)`` for a full one.

    Raises:
        ValueError: ``init`` is not local yet, or naming ``init.ref`` and every field that differs
            (``peagle_core.warm_start.check_head_matches``), with the fix.
    """
    if init.head_dir is None:
        raise ValueError(f"training.init_from={init.ref!r} is a registry head: download it first "
                         "(pipelines.train.warm_start.fetch_init_head; the train stage does)")
    try:
        config = check_head_matches(init.head_dir, drafter)
    except HeadContractError as e:
        raise ValueError(f"training.init_from={init.ref!r} ({init.describe()}) cannot initialize this recipe's "
                         f"drafter: {e}. Set the drafter section (num_layers, draft_vocab_size, mask_token_id), "
                         "training.method and the target to the head's, or drop training.init_from to train "
                         "from scratch") from None
    head_target = (config.get("peagle") or {}).get("target_sha256")
    if target_sha256 and head_target and head_target != target_sha256:
        log.warning("training.init_from=%s was trained for target weights %s…, this run's target is %s…: same "
                    "architecture, other weights; the warm start may help less", init.ref, head_target[:12],
                    target_sha256[:12])
    if drafter.draft_vocab_size == drafter.vocab_size:
        return None, None
    from safetensors import safe_open

    with safe_open(str(Path(init.head_dir) / WEIGHTS_FILE), framework="pt") as f:
        return f.get_tensor("d2t").to(torch.long), f.get_tensor("t2d").to(torch.bool)


def load_init_weights(drafter: Eagle3Drafter, init: InitHead, *, train_embed_tokens: bool = True) -> list[str]:
    """Load the head over a drafter built from the plan (step 4; the plan installed the head's ``d2t``/``t2d``).

    With ``train_embed_tokens=False`` the drafter keeps the target's embeddings (vLLM will share them, as
    the exported head omits ``embed_tokens``); a head's own ``embed_tokens`` are then ignored, with a warning.

    Returns:
        The names of the tensors loaded.

    Raises:
        peagle_core.contract.HeadContractError: the weights do not fit (``load_head_weights``).
    """
    assert init.head_dir is not None, "the plan holds a local head (fetch_init_head)"
    names = load_head_weights(drafter, init.head_dir, embed_tokens=train_embed_tokens)
    if not train_embed_tokens:
        from safetensors import safe_open

        with safe_open(str(Path(init.head_dir) / WEIGHTS_FILE), framework="pt") as f:
            if EMBED in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                log.warning("training.init_from=%s: the head's embed_tokens are ignored (drafter.train_embed_tokens="
                            "false keeps the target's, which vLLM shares with the exported head)", init.ref)
    return names
