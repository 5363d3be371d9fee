"""Where vLLM releases read a P-EAGLE head's parallel-drafting mask token (part of :mod:`peagle_core.contract`, which
re-exports every name here): the releases a head must load in (:data:`VLLM_RANGE`), the one table of mask-token
keys (:data:`MASK_TOKEN_KEYS`) and their checks.

Source: ``vllm/v1/spec_decode/llm_base_proposer.py::_init_parallel_drafting_params`` of vLLM 0.26 and 0.32.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple


class HeadContractError(ValueError):
    """A head directory violates the vLLM contract or does not fit its target; names the field."""


# The first vLLM release without P-EAGLE (checked in the 0.34.0 wheel, 2026-12-02): its speculators config raises
# "P-EAGLE (parallel drafting EAGLE-3) is not supported", `parallel_drafting` is deprecated and refused for any
# method but dflash / dspark (config/speculative.py), llama_eagle3.py skips `mask_hidden` when loading, and the V1
# model runner (v1/worker/gpu_model_runner.py, the only one that drafted a P-EAGLE head) is gone.
PARALLEL_DRAFTING_REMOVED: tuple[int, int] = (0, 34)
# vLLM releases (major, minor) a head must load in: lower bound included, upper excluded. pyproject.toml's `gpu`
# extra states the same range (tests/unit/test_contract.py keeps them equal).
VLLM_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((0, 26), PARALLEL_DRAFTING_REMOVED)
VLLM_SPEC = f">={VLLM_RANGE[0][0]}.{VLLM_RANGE[0][1]},<{VLLM_RANGE[1][0]}.{VLLM_RANGE[1][1]}"
UPGRADE_COMMAND = "peagle head upgrade"  # pipelines/cli/head.py: adds the missing keys (upgrade_head)


class MaskTokenKey(NamedTuple):
    """A top-level ``config.json`` key vLLM reads a parallel-drafting head's mask token id from.

    ``read_since``: the first vLLM release of :data:`VLLM_RANGE` known to read it (every later one of the range
    does); ``exported``: :func:`head_config_dict` writes it.
    """

    name: str
    read_since: tuple[int, int]
    exported: bool


# The one table of mask-token keys. Checked in the sources of vLLM 0.26 and 0.32
# (v1/spec_decode/llm_base_proposer.py::_init_parallel_drafting_params): 0.26 reads pard_token, then ptd_token_id;
# 0.32 reads mask_token_id first, then pard_token, then ptd_token_id. 0.27-0.31 were not checked: they are held to
# 0.26's rule (mask_token_id is trusted from 0.32 on); 0.33 to 0.32's.
MASK_TOKEN_KEYS: tuple[MaskTokenKey, ...] = (
    MaskTokenKey("mask_token_id", (0, 32), exported=True),
    MaskTokenKey("ptd_token_id", (0, 26), exported=True),   # parallel token drafting (P-EAGLE's own key in 0.26)
    MaskTokenKey("pard_token", (0, 26), exported=False),    # PARD's key; imported heads may carry only this one
)


def vllm_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``"0.32.0"``, ``"0.32.0+cpu"``, ``"0.33.1.dev4+g1a2b"``).

    Raises:
        ValueError: the string does not start with ``MAJOR.MINOR``.
    """
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"vLLM version {version!r} does not start with MAJOR.MINOR")
    return int(m.group(1)), int(m.group(2))


def vllm_supported(version: str) -> bool:
    """Whether ``version`` lies in :data:`VLLM_RANGE` (the releases peagle heads are checked against).

    Raises:
        ValueError: as :func:`vllm_release`.
    """
    return VLLM_RANGE[0] <= vllm_release(version) < VLLM_RANGE[1]


def vllm_unsupported_reason(version: str) -> str | None:
    """Why vLLM ``version`` cannot serve a peagle head (a phrase to follow the version in a message), or None when
    it lies in :data:`VLLM_RANGE`. From :data:`PARALLEL_DRAFTING_REMOVED` on the reason is vLLM's: no parallel
    drafting for EAGLE-3.

    Raises:
        ValueError: as :func:`vllm_release`.
    """
    if vllm_supported(version):
        return None
    if vllm_release(version) < PARALLEL_DRAFTING_REMOVED:
        return f"older than the releases peagle heads are checked against; install vllm{VLLM_SPEC}"
    major, minor = PARALLEL_DRAFTING_REMOVED
    return (f"vLLM {major}.{minor} removed P-EAGLE, parallel drafting for EAGLE-3 (it refuses parallel_drafting for "
            f"method eagle3 and drops a head's mask_hidden); install vllm{VLLM_SPEC} ({major}.{minor - 1} is the last "
            "release that drafts a P-EAGLE head)")


def mask_token_keys(vllm_version: str) -> tuple[str, ...]:
    """The ``config.json`` keys vLLM ``vllm_version`` reads a parallel-drafting head's mask token from
    (:data:`MASK_TOKEN_KEYS`), e.g. ``("ptd_token_id", "pard_token")`` for ``"0.26.0"``.

    Raises:
        ValueError: an unparsable version, or one outside :data:`VLLM_RANGE` (whose keys were never checked).
    """
    reason = vllm_unsupported_reason(vllm_version)
    if reason is not None:
        raise ValueError(f"vLLM {vllm_version}: {reason}")
    return _keys_read_by(vllm_release(vllm_version))


def _keys_read_by(release: tuple[int, int]) -> tuple[str, ...]:
    return tuple(k.name for k in MASK_TOKEN_KEYS if k.read_since <= release)


def _rule_releases() -> list[tuple[int, int]]:
    """One release per distinct rule of :data:`VLLM_RANGE`: its first release and every ``read_since`` inside it."""
    lo, hi = VLLM_RANGE
    return sorted({lo} | {k.read_since for k in MASK_TOKEN_KEYS if lo < k.read_since < hi})


NO_MASK_TOKEN = (f"config.json has no mask token id (any of {[k.name for k in MASK_TOKEN_KEYS]}) but parallel_drafting "
                  "is requested: serve this head without parallel_drafting (an EAGLE-3 head) or export a P-EAGLE head")


def head_mask_token_id(config: Mapping[str, Any]) -> int | None:
    """The parallel-drafting mask token id a head's ``config.json`` carries under any key of
    :data:`MASK_TOKEN_KEYS` (a null value counts as absent), or None (an EAGLE-3 head).

    Raises:
        HeadContractError: a key holds something other than an integer, or two keys disagree (vLLM releases
            would draft with different tokens: 0.32 reads ``mask_token_id`` first, 0.26 ``pard_token``).
    """
    found: dict[str, Any] = {k.name: config[k.name] for k in MASK_TOKEN_KEYS if config.get(k.name) is not None}
    for name, value in found.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise HeadContractError(f"config.json {name}={value!r}: a mask token id is an integer token id")
    if len(set(found.values())) > 1:
        raise HeadContractError(f"config.json mask token keys disagree: {found}; vLLM releases read different "
                                "keys, so they must hold the same token id: fix config.json or re-export the head")
    return next(iter(found.values()), None)


def check_mask_token_keys(config: Mapping[str, Any], vllm_version: str | None = None) -> None:
    """Check that vLLM ``vllm_version`` (None: every release of :data:`VLLM_RANGE`) finds the mask token of a
    parallel-drafting head's ``config.json``.

    Raises:
        HeadContractError: no mask token key at all, disagreeing keys, a null one (vLLM takes a key that is
            present even when null), or a release that reads none of the keys present (naming the keys it
            reads and the fix: ``peagle head upgrade DIR`` or a re-export).
        ValueError: ``vllm_version`` unparsable or outside :data:`VLLM_RANGE`.
    """
    if head_mask_token_id(config) is None:
        raise HeadContractError(NO_MASK_TOKEN)
    nulls = [k.name for k in MASK_TOKEN_KEYS if k.name in config and config[k.name] is None]
    if nulls:
        raise HeadContractError(f"config.json has {nulls} set to null: vLLM reads a key that is present even when "
                                "null; drop it or set it to the mask token id")
    present = [k.name for k in MASK_TOKEN_KEYS if k.name in config]
    if vllm_version is not None:
        mask_token_keys(vllm_version)  # ValueError: unparsable, or outside the range
        releases = [vllm_release(vllm_version)]
    else:
        releases = _rule_releases()
    for release in releases:
        reads = _keys_read_by(release)
        if not set(reads) & set(present):
            add = [k.name for k in MASK_TOKEN_KEYS if k.exported and k.name not in present]
            raise HeadContractError(
                f"config.json carries the parallel-drafting mask token as {present} only, but vLLM "
                f"{release[0]}.{release[1]} reads it from {list(reads)} and refuses the head without one: add "
                f"{add} with `{UPGRADE_COMMAND} HEAD_DIR` (or re-export the head with this peagle)")
