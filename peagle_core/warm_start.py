"""Warm start of a drafter from an exported head: the architecture check and the weight copy.

:func:`check_head_matches` checks that a head directory (valid under :mod:`peagle_core.contract`) has the
architecture of the drafter to train (every field of :data:`MATCH_FIELDS`); :func:`load_head_weights`
then copies its weights into that drafter. Resolving ``training.init_from`` (registry reference or
directory), downloading and digest checks are the pipeline's: :mod:`pipelines.train.warm_start`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from peagle_core.contract import (
    CONFIG_FILE,
    EMBED,
    VOCAB_MAP_TENSORS,
    WEIGHTS_FILE,
    HeadContractError,
    drafter_config_from_head,
    head_mask_token_id,
    validate_head,
)
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig

# DrafterConfig fields a head must share with a drafter it initializes (a warm start): the weight shapes
# and what the weights mean. Not compared: max_position_embeddings (RoPE table length) and
# target_num_hidden_layers (only bounds the aux ids, which are compared).
MATCH_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "rope_parameters", "vocab_size", "draft_vocab_size", "target_hidden_size",
    "aux_layer_ids", "mask_token_id", "norm_before_residual", "norm_before_fc", "fc_norm", "attention_bias",
    "norm_output",
)


def check_head_matches(head_dir: str | os.PathLike, expected: DrafterConfig) -> dict:
    """Check that a head can initialize a drafter of architecture ``expected`` (a warm start): the head
    passes :func:`validate_head` (parallel drafting inferred from its mask token id; the keys only vLLM reads
    are not required) and its config
    equals ``expected`` on every field of :data:`MATCH_FIELDS`.

    Returns:
        The head's parsed ``config.json``.

    Raises:
        HeadContractError: the head is invalid, or naming every field that differs (head value, expected
            value); a P-EAGLE head for an EAGLE-3 drafter or the reverse is reported as the method.
    """
    d = Path(head_dir)
    config = json.loads((d / CONFIG_FILE).read_text()) if (d / CONFIG_FILE).is_file() else {}
    validate_head(d, parallel_drafting=head_mask_token_id(config) is not None, for_vllm=False)  # torch loads it
    have = drafter_config_from_head(config)
    problems = []
    head_pd, want_pd = have.mask_token_id is not None, expected.mask_token_id is not None
    if head_pd != want_pd:
        kind = {True: "P-EAGLE (parallel drafting: mask_token_id, mask_hidden)", False: "EAGLE-3 (no mask_hidden)"}
        problems.append(f"method: the head is {kind[head_pd]}, the drafter to train is {kind[want_pd]}")
    for name in MATCH_FIELDS:
        if name == "mask_token_id" and head_pd != want_pd:
            continue
        a, b = getattr(have, name), getattr(expected, name)
        if a != b:
            problems.append(f"{name}: head {a}, expected {b}")
    if problems:
        raise HeadContractError(f"{d} does not fit the drafter it should initialize: " + "; ".join(problems))
    return config


@torch.no_grad()
def load_head_weights(drafter: Eagle3Drafter, head_dir: str | os.PathLike, *, embed_tokens: bool = True) -> list[str]:
    """Copy a head's weights into ``drafter`` (same architecture: check it with :func:`check_head_matches`
    first); floating tensors are cast to the drafter's dtypes.

    ``d2t``/``t2d`` (present for a pruned draft vocabulary) are not copied: the drafter must already hold the
    head's mapping (``set_vocab_mapping``), else the ``lm_head`` rows would mean other tokens. A head without
    ``embed_tokens`` (exported with frozen target embeddings) leaves the drafter's embeddings as they are;
    ``embed_tokens=False`` does the same for a head that has them.

    Returns:
        The names of the tensors copied.

    Raises:
        HeadContractError: a drafter tensor the head lacks, a head tensor the drafter lacks, a shape that
            differs, or a vocabulary mapping that differs from the drafter's.
    """
    state = load_file(str(Path(head_dir) / WEIGHTS_FILE))
    own = drafter.state_dict()
    for name in VOCAB_MAP_TENSORS:
        if name in state and not torch.equal(state.pop(name).to(own[name].dtype), own[name].cpu()):
            raise HeadContractError(f"{head_dir}: {name} differs from the drafter's vocabulary mapping; install "
                                    "the head's d2t/t2d (set_vocab_mapping) before loading its weights")
    if not embed_tokens:
        state.pop(EMBED, None)
    missing = sorted(set(own) - set(state) - {EMBED, *VOCAB_MAP_TENSORS})
    unknown = sorted(set(state) - set(own))
    shapes = [f"{n} {tuple(state[n].shape)} vs {tuple(own[n].shape)}" for n in sorted(set(state) & set(own))
              if state[n].shape != own[n].shape]
    if missing or unknown or shapes:
        raise HeadContractError(f"{head_dir}: weights do not fit the drafter: missing {missing[:6]}, unexpected "
                                f"{unknown[:6]}, shapes {shapes[:6]}")
    drafter.load_state_dict(state, strict=False)  # copy_ into the existing tensors (dtype and device kept)
    return sorted(state)


__all__ = ["MATCH_FIELDS", "check_head_matches", "load_head_weights"]
