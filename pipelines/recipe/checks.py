"""Checks that need the real target (its config and tokenizer): run right after loading it, before compute."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.recipe.load import Recipe

log = logging.getLogger(__name__)


def chat_template_token_ids(tokenizer) -> set[int]:
    """Token ids in the chat template's rendering of a system/user/assistant/user conversation
    (with and without the system turn, with a generation prompt). The contents are single letters,
    so every special token in the result comes from the template itself."""
    convo = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ]
    ids: set[int] = set()
    for messages in (convo, convo[1:]):
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - templates raise anything (jinja errors, ValueError) on a system turn
            log.debug("chat template rejected %s: %s", [m["role"] for m in messages], e)
            continue
        ids.update(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("the target tokenizer's chat template could not render a user/assistant conversation")
    return ids


def validate_against_target(recipe: Recipe, hf_config, tokenizer) -> None:
    """Checks that need the real target: call right after loading it, before any compute.

    ``hf_config``: the target's ``transformers.PretrainedConfig`` (or a dict); ``tokenizer``: its
    tokenizer (with chat template).

    Raises:
        ValueError: listing every problem: declared num_hidden_layers/hidden_size/vocab_size differ
            from the real config; aux layer ids outside [0, N); mask_token_id outside the embedding,
            an ordinary text token, a bos/eos/pad/unk token, or a token the chat template emits;
            draft_vocab_size > vocab.
    """
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    t, d = recipe.target, recipe.drafter
    problems = []
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        declared = getattr(t, key)
        if declared is not None and declared != cfg.get(key):
            problems.append(f"target.{key}={declared} but the target config says {cfg.get(key)}; fix or drop it")
    n, v = cfg["num_hidden_layers"], cfg["vocab_size"]
    try:
        t.resolve_aux_layer_ids(n)
    except ValueError as e:
        problems.append(str(e))
    m = d.mask_token_id
    if m is None or m < 0 or m >= v:
        problems.append(f"drafter.mask_token_id={m} is outside the target embedding [0, {v}); pick a reserved id")
    else:
        special = {
            tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
        } | set(_as_list(cfg.get("eos_token_id")))
        added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        name = tokenizer.convert_ids_to_tokens(m) if m < len(tokenizer) else None
        if m in special:
            problems.append(f"drafter.mask_token_id={m} ({name!r}) is the target's bos/eos/pad/unk token; "
                            "pick a reserved, unused id")
        elif m in chat_template_token_ids(tokenizer):
            problems.append(f"drafter.mask_token_id={m} ({name!r}) is emitted by the chat template; "
                            "pick a reserved token the template never uses")
        elif m < len(tokenizer) and m not in added:
            problems.append(f"drafter.mask_token_id={m} is the ordinary text token {name!r}; pick a reserved "
                            "special token (or an unused embedding row >= len(tokenizer))")
    if d.draft_vocab_size is not None and d.draft_vocab_size > v:
        problems.append(f"drafter.draft_vocab_size={d.draft_vocab_size} > target vocab_size={v}; use <= {v}")
    if problems:
        raise ValueError(f"recipe {recipe.name!r} does not fit target {t.model!r}:\n  " + "\n  ".join(problems))


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
