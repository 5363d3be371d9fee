"""Reference speculative decoder for HF transformers targets: peagle's offline evaluator and GPU
benchmark engine.

Greedy verification (lossless: the output equals target-only greedy decoding), batched with
per-sequence acceptance and padding. Methods:

- ``none``: target-only greedy decoding (the baseline and the losslessness reference);
- ``eagle3``: sequential EAGLE-3 drafting, K drafter forwards per step;
- ``peagle``: P-EAGLE parallel drafting, ONE drafter forward per step (arXiv 2602.01469).

It mirrors vLLM's bookkeeping (``vllm/v1/spec_decode/llm_base_proposer.py``): each step the drafter
receives the newly verified positions with the target's aux hidden states (slot at position p =
token x[p+1] + aux at p), the anchor's token is the bonus token sampled by the target, and the
speculative slots are discarded after drafting. Acceptance length AL = 1 + accepted / drafts.

Shape legend: B batch, T tokens, K num_speculative_tokens, Ht target hidden.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_cache import DrafterCache
from peagle_core.target import target_forward

Method = Literal["none", "eagle3", "peagle"]
METHODS: tuple[str, ...] = ("none", "eagle3", "peagle")


@dataclass
class DecodeResult:
    """Outputs and statistics of one ``speculative_generate`` call.

    ``output_ids``: generated ids per sequence (prompt excluded). Counters follow vLLM's
    spec-decode metrics: ``num_drafts`` (verification steps that carried drafts),
    ``num_draft_tokens`` (= K * num_drafts), ``num_accepted_tokens``, ``accepted_per_pos [K]``.
    Times in seconds; ``target_s``/``drafter_s`` split the model time.
    """

    output_ids: list[list[int]]
    method: str
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    target_s: float = 0.0
    drafter_s: float = 0.0
    num_steps: int = 0

    @property
    def acceptance_length(self) -> float:
        """AL = 1 + accepted / drafts (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "method": self.method, "K": self.num_speculative_tokens,
            "acceptance_length": self.acceptance_length,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "num_drafts": self.num_drafts, "num_accepted_tokens": self.num_accepted_tokens,
            "tokens": self.num_generated_tokens, "tokens_per_s": self.tokens_per_s,
            "wall_s": self.wall_s, "target_s": self.target_s, "drafter_s": self.drafter_s,
            "steps": self.num_steps,
        }


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Eagle3Drafter | None = None,
    method: Method = "peagle",
    num_speculative_tokens: int = 5,
    max_new_tokens: int = 64,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    batch_size: int | None = None,
) -> DecodeResult:
    """Greedy speculative decoding of prompts, all in one batch or in batches of ``batch_size``.

    On CUDA, attention runs without cuDNN's SDPA backend: it builds an execution plan on the host
    for every new shape (0.7-2.7 ms per call measured on an H200, ``bench/results/
    decode_profile_cudnn.json``), and the KV length grows every step, so each call is a new shape.

    Args:
        target: HF causal LM (Llama-style, ``model.model.layers``), in eval mode.
        prompts: token ids per sequence (lengths may differ; left-padded internally).
        drafter: the head; required unless ``method="none"``. Its ``aux_layer_ids`` choose the
            target layers captured.
        method: ``none`` | ``eagle3`` | ``peagle``.
        num_speculative_tokens: K >= 1 draft tokens per step.
        max_new_tokens: per sequence; generation also stops at ``eos_token_id``.
        eos_token_id: one id or several.
        batch_size: sequences decoded together (the concurrency), ``prompts`` taken in order;
            ``None`` = all of them. Counters and times are summed over the batches.

    Returns:
        ``DecodeResult`` (``output_ids`` in prompt order).

    Raises:
        ValueError: unknown method, K < 1, empty prompt, missing drafter, ``peagle`` with a head
            lacking ``mask_hidden``, ``batch_size`` < 1; all before any decoding.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {METHODS}")
    if method != "none" and drafter is None:
        raise ValueError(f"method={method!r} needs a drafter head")
    if method == "peagle" and not drafter.parallel_drafting:
        raise ValueError("method='peagle' needs a head with mask_hidden/mask_token_id; use method='eagle3'")
    K = num_speculative_tokens if method != "none" else 0
    if method != "none" and K < 1:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    step = batch_size or len(prompts)
    res = DecodeResult(output_ids=[], method=method, num_speculative_tokens=K, accepted_per_pos=[0] * K)
    with decoding_attention(next(target.parameters()).device):
        for s in range(0, len(prompts), step):
            r = _generate_batch(target, prompts[s:s + step], drafter, method, K, max_new_tokens, eos_token_id,
                                pad_token_id)
            res.output_ids += r.output_ids
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "wall_s", "target_s", "drafter_s",
                         "num_steps"):
                setattr(res, name, getattr(res, name) + getattr(r, name))
            res.accepted_per_pos = [a + b for a, b in zip(res.accepted_per_pos, r.accepted_per_pos)]
    return res


def decoding_attention(device: torch.device):
    """Context manager: the SDPA backends for decoding on ``device``; on CUDA all but cuDNN (see
    ``speculative_generate``), elsewhere unchanged."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _generate_batch(target, prompts, drafter, method, K, max_new_tokens, eos_token_id, pad_token_id) -> DecodeResult:
    """One batch of ``speculative_generate`` (arguments already checked; ``K`` = 0 for ``none``)."""
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    device = next(target.parameters()).device
    layer_ids = tuple(drafter.config.aux_layer_ids) if drafter is not None else (0,)
    timer = _Timer(device)
    res = DecodeResult(output_ids=[[] for _ in prompts], method=method, num_speculative_tokens=K,
                       accepted_per_pos=[0] * K)
    t_start = timer.now()

    # --- prefill: left-padded prompts, explicit positions -----------------------------------
    B = len(prompts)
    ids, valid, pos = _left_pad(prompts, pad_token_id, device)
    attn = valid.long()  # [B, S] key mask of the target cache, grows every step
    t0 = timer.now()
    out = target_forward(target, ids, layer_ids, attention_mask=attn, position_ids=pos, use_cache=True)
    res.target_s += timer.now() - t0
    past = out.past_key_values
    bonus = out.logits[:, -1].argmax(-1)  # [B] first generated token
    next_pos = pos[:, -1] + 1  # [B] position of the bonus token
    done = torch.zeros(B, dtype=torch.bool, device=device)
    _append(res, done, bonus[:, None], torch.ones(B, dtype=torch.long, device=device), eos, max_new_tokens)

    cache = DrafterCache(drafter.config.num_hidden_layers) if drafter is not None else None
    drafts = None
    if drafter is not None and not bool(done.all()):
        # Drafter slots at positions 0..L-1: token x[p+1] (prompt shifted, then the bonus), aux at p.
        d_ids = torch.cat([ids[:, 1:], bonus[:, None]], 1)
        t0 = timer.now()
        drafts = _draft(drafter, method, d_ids, out.aux.to(_dtype(drafter)), pos, K, cache, valid)
        res.drafter_s += timer.now() - t0

    # --- decode loop -----------------------------------------------------------------------
    while not bool(done.all()):
        res.num_steps += 1
        block = bonus[:, None] if drafts is None else torch.cat([bonus[:, None], drafts], 1)  # [B, 1+K]
        block_pos = next_pos[:, None] + torch.arange(block.shape[1], device=device)
        attn = torch.cat([attn, torch.ones_like(block)], 1)
        t0 = timer.now()
        out = target_forward(target, block, layer_ids, attention_mask=attn, position_ids=block_pos,
                             past_key_values=past, use_cache=True)
        res.target_s += timer.now() - t0
        past = out.past_key_values
        greedy = out.logits.argmax(-1)  # [B, 1+K]: target's choice after each block token
        if drafts is not None:
            match = (drafts == greedy[:, :-1]).long()
            n_acc = match.cumprod(1).sum(1)  # [B] leading matches
        else:
            n_acc = torch.zeros(B, dtype=torch.long, device=device)
        if drafts is not None:
            _count_accepted(res, n_acc[~done], K)
        rows = torch.arange(B, device=device)
        new_bonus = greedy[rows, n_acc]  # [B]
        # Emit accepted drafts then the bonus.
        emitted = torch.cat([drafts, new_bonus[:, None]], 1) if drafts is not None else new_bonus[:, None]
        if drafts is not None:
            emitted = torch.where(torch.arange(K + 1, device=device)[None] < n_acc[:, None], emitted,
                                  new_bonus[:, None].expand(-1, K + 1))
        _append(res, done, emitted, n_acc + 1, eos, max_new_tokens)
        # Rejected block entries leave the target's attention (holes in the key mask).
        keep = torch.arange(block.shape[1], device=device)[None] <= n_acc[:, None]  # [B, 1+K]
        attn[:, -block.shape[1]:] = keep.long()
        if drafter is not None and not bool(done.all()):
            # New committed drafter slots: positions next_pos .. next_pos+n (tokens block[1:]+bonus).
            slot_ids = torch.cat([block[:, 1:], new_bonus[:, None]], 1)  # [B, 1+K]
            slot_ids = torch.where(keep, slot_ids, torch.full_like(slot_ids, pad_token_id))
            # slot j holds the token after block[j]: accepted draft j+1, or the bonus at j = n.
            slot_ids = torch.where(torch.arange(K + 1, device=device)[None] == n_acc[:, None],
                                   new_bonus[:, None].expand(-1, K + 1), slot_ids)
            t0 = timer.now()
            drafts = _draft(drafter, method, slot_ids, out.aux.to(_dtype(drafter)), block_pos, K, cache, keep)
            res.drafter_s += timer.now() - t0
        bonus = new_bonus
        next_pos = next_pos + n_acc + 1
    res.wall_s = timer.now() - t_start
    return res


def _left_pad(prompts, pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: ``(ids [B, L], valid [B, L] bool, positions [B, L])``;
    positions count from 0 at each prompt's first token (0 on padding)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_token_id, dtype=torch.long, device=device)
    valid = torch.zeros((B, L), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(list(p), device=device)
        valid[i, L - len(p):] = True
    return ids, valid, (valid.long().cumsum(1) - 1).clamp(min=0)


def _count_accepted(res: DecodeResult, n_acc: torch.Tensor, K: int) -> None:
    """Add one verification step of the active rows to the counters (``n_acc [B_active]`` accepted
    drafts per row, each of ``K`` drafted tokens)."""
    n_active = int(n_acc.numel())
    res.num_drafts += n_active
    res.num_draft_tokens += n_active * K
    res.num_accepted_tokens += int(n_acc.sum())
    for j in range(K):
        res.accepted_per_pos[j] += int((n_acc > j).sum())


def _dtype(m: nn.Module) -> torch.dtype:
    return next(m.parameters()).dtype


def _draft(drafter, method, ids, aux, pos, K, cache, valid) -> torch.Tensor:
    fn = drafter.draft_parallel if method == "peagle" else drafter.draft_sequential
    return fn(ids, aux, pos, K, cache, query_valid=valid)


def _append(res: DecodeResult, done: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
            eos: set[int], max_new_tokens: int) -> None:
    """Append ``emitted[i, :counts[i]]`` to unfinished rows, stopping at EOS / max_new_tokens."""
    em, cnt = emitted.tolist(), counts.tolist()
    for i, out in enumerate(res.output_ids):
        if done[i]:
            continue
        for tok in em[i][: cnt[i]]:
            out.append(tok)
            if tok in eos or len(out) >= max_new_tokens:
                done[i] = True
                break
