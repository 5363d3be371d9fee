"""Distillation loss through the vocabulary projection without materializing ``[M, Vd]`` logits.

For M loss elements with drafter outputs ``h [M, H]`` (after the final norm) and the target's
final hidden states ``ht [M, Ht]``::

    draft logits  zd = h  @ Wd.T      # [M, Vd], Wd = drafter lm_head [Vd, H]
    target logits zt = ht @ Wt.T      # [M, Vd], Wt = target lm_head rows of the draft vocab
    kl:  row_loss = sum_v p_v (log p_v - log q_v),  p = softmax(zt), q = softmax(zd)
    ce:  row_loss = -log q[argmax zt]
    loss = sum_rows row_scale * row_loss                 (the differentiable output)

Gradients go to ``h`` and ``Wd`` only (the target is frozen): ``dL/dzd = row_scale * (q - p)``
(``q - onehot`` for ce), so ``dh = dzd @ Wd`` and ``dWd = dzd.T @ h``. The chunked
implementations compute these per chunk of rows inside the forward (as Liger-Kernel's fused
linear cross-entropy does) and only scale them by the incoming scalar gradient in backward:
peak extra memory is a few ``[chunk_rows, Vd]`` float32 buffers plus ``[M, H]`` and ``[Vd, H]``
gradients, instead of several ``[M, Vd]`` tensors.

Implementations: ``"plain"`` (materializes logits; reference), ``"torch"`` (chunked; the CPU
path), ``"triton"`` (chunked, with one fused Triton kernel per chunk for the softmaxes, loss,
argmaxes and ``dzd`` written in place; projections by cuBLAS; CUDA only), ``"auto"`` (triton on
CUDA when importable, else torch).

Shape legend: M rows (loss elements), H drafter hidden, Ht target hidden, Vd draft vocab.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

LossImpl = Literal["auto", "torch", "triton", "plain"]
LossKind = Literal["kl", "ce"]


@dataclass
class DistillOutput:
    """Result of ``linear_distill_loss``.

    Args:
        loss: scalar, ``sum(row_scale * row_loss)``; differentiable w.r.t. ``h`` and ``Wd``.
        row_loss: ``[M]`` float32 per-row loss (detached).
        draft_argmax: ``[M]`` int64 draft-vocabulary argmax of ``zd``.
        target_argmax: ``[M]`` int64 draft-vocabulary argmax of ``zt``.
    """

    loss: torch.Tensor
    row_loss: torch.Tensor
    draft_argmax: torch.Tensor
    target_argmax: torch.Tensor


def _check(h, Wd, ht, Wt, row_scale, kind) -> None:
    if kind not in ("kl", "ce"):
        raise ValueError(f"kind={kind!r}: use 'kl' or 'ce'")
    if h.dim() != 2 or ht.dim() != 2 or h.shape[0] != ht.shape[0]:
        raise ValueError(f"draft hidden {tuple(h.shape)} and target hidden {tuple(ht.shape)} must be [M, *] with equal M")
    if Wd.shape[1] != h.shape[1] or Wt.shape[1] != ht.shape[1] or Wd.shape[0] != Wt.shape[0]:
        raise ValueError(f"weights {tuple(Wd.shape)} / {tuple(Wt.shape)} do not fit hidden {tuple(h.shape)} / "
                         f"{tuple(ht.shape)} (need Wd [Vd, H], Wt [Vd, Ht])")
    if row_scale.shape != (h.shape[0],):
        raise ValueError(f"row_scale has shape {tuple(row_scale.shape)}, expected [M]=({h.shape[0]},)")


def plain_distill_loss(h, Wd, ht, Wt, row_scale, kind: LossKind = "kl") -> DistillOutput:
    """Reference: materializes ``[M, Vd]`` logits, autograd does the rest."""
    zd = (h @ Wd.to(h.dtype).T).float()
    zt = (ht @ Wt.to(ht.dtype).T).float()
    lq = F.log_softmax(zd, -1)
    tgt = zt.argmax(-1)
    if kind == "kl":
        lp = F.log_softmax(zt, -1)
        row = (lp.exp() * (lp - lq)).sum(-1)
    else:
        row = -lq.gather(1, tgt[:, None])[:, 0]
    loss = (row * row_scale.float()).sum()
    return DistillOutput(loss, row.detach(), zd.argmax(-1), tgt)


def _chunk_torch(zd: torch.Tensor, zt: torch.Tensor, scale: torch.Tensor, kind: str, need_grad: bool):
    """One chunk, torch ops: ``(row_loss [C], dzd [C, Vd] or None, draft_argmax, target_argmax)``."""
    zd, zt = zd.float(), zt.float()
    lq = F.log_softmax(zd, -1)
    tgt = zt.argmax(-1)
    if kind == "kl":
        lp = F.log_softmax(zt, -1)
        p = lp.exp()
        row = (p * (lp - lq)).sum(-1)
    else:
        row = -lq.gather(1, tgt[:, None])[:, 0]
    arg = zd.argmax(-1)
    if not need_grad:
        return row, None, arg, tgt
    g = lq.exp_()
    if kind == "kl":
        g.sub_(p)
    else:
        g[torch.arange(g.shape[0], device=g.device), tgt] -= 1.0
    g.mul_(scale[:, None])
    return row, g, arg, tgt


class _ChunkedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, Wd, ht, Wt, row_scale, kind, chunk_rows, use_triton, need_grad, compute_dtype):
        # Explicit dtypes instead of autocast: matmuls in compute_dtype (bf16 under autocast),
        # softmaxes and the running dWd sum in float32, gradients returned in the inputs' dtypes.
        with torch.autocast(h.device.type, enabled=False):
            M, cd = h.shape[0], compute_dtype
            hc, Wd_c, htc, Wt_c = h.to(cd), Wd.to(cd), ht.to(cd), Wt.to(cd)
            scale = row_scale.float()
            row = torch.empty(M, dtype=torch.float32, device=h.device)
            arg = torch.empty(M, dtype=torch.long, device=h.device)
            tgt = torch.empty(M, dtype=torch.long, device=h.device)
            gh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_grad else None
            gW = torch.zeros(Wd.shape, dtype=torch.float32, device=h.device) if need_grad else None
            for s in range(0, M, chunk_rows):
                e = min(s + chunk_rows, M)
                zd = hc[s:e] @ Wd_c.T  # [C, Vd]
                zt = htc[s:e] @ Wt_c.T  # [C, Vd]
                if use_triton:
                    from peagle_core.kernels.distill import chunk_distill_triton

                    r, g, a, t = chunk_distill_triton(zd, zt, scale[s:e], kind, need_grad)
                else:
                    r, g, a, t = _chunk_torch(zd, zt, scale[s:e], kind, need_grad)
                row[s:e], arg[s:e], tgt[s:e] = r, a, t
                if need_grad:
                    g = g.to(cd)
                    gh[s:e] = g @ Wd_c
                    if cd == torch.float32:
                        gW.addmm_(g.T, hc[s:e])
                    else:  # low-precision matmul (fp32 accumulate inside), fp32 running sum
                        gW.add_(g.T @ hc[s:e])
            loss = (row * scale).sum()
        if need_grad:
            ctx.save_for_backward(gh, gW.to(Wd.dtype))
        ctx.mark_non_differentiable(row, arg, tgt)
        return loss, row, arg, tgt

    @staticmethod
    def backward(ctx, grad_loss, *_):
        gh, gW = ctx.saved_tensors
        return gh * grad_loss.to(gh.dtype), gW * grad_loss.to(gW.dtype), None, None, None, None, None, None, None, None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_loss_impl(impl: LossImpl, device: torch.device) -> str:
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if impl not in ("torch", "triton", "plain"):
        raise ValueError(f"loss_impl={impl!r}: use 'auto', 'torch', 'triton' or 'plain'")
    return impl


def linear_distill_loss(
    h: torch.Tensor,
    Wd: torch.Tensor,
    ht: torch.Tensor,
    Wt: torch.Tensor,
    *,
    row_scale: torch.Tensor | None = None,
    kind: LossKind = "kl",
    impl: LossImpl = "auto",
    chunk_rows: int = 1024,
) -> DistillOutput:
    """KL(target || draft) or CE-on-target-argmax through both vocabulary projections.

    Args:
        h: ``[M, H]`` drafter outputs after the final norm.
        Wd: ``[Vd, H]`` drafter ``lm_head`` weight.
        ht: ``[M, Ht]`` target final hidden states (after the target's final norm); no gradient.
        Wt: ``[Vd, Ht]`` target ``lm_head`` rows of the draft vocabulary; no gradient.
        row_scale: ``[M]`` weight of each row in ``loss`` (e.g. ``1 / num_loss_elements``,
            times a TTT step weight); default ones.
        kind: ``"kl"`` or ``"ce"``.
        impl: ``"auto"``, ``"torch"``, ``"triton"`` or ``"plain"`` (see module doc).
        chunk_rows: rows per chunk for the chunked implementations.

    Returns:
        ``DistillOutput`` (loss, row_loss, draft_argmax, target_argmax).

    Raises:
        ValueError: shape mismatch, unknown ``kind``/``impl``; ``impl="triton"`` without CUDA.
    """
    if row_scale is None:
        row_scale = torch.ones(h.shape[0], device=h.device, dtype=torch.float32)
    _check(h, Wd, ht, Wt, row_scale, kind)
    ht, Wt = ht.detach(), Wt.detach()
    which = resolve_loss_impl(impl, h.device)
    if which == "plain":
        return plain_distill_loss(h, Wd, ht, Wt, row_scale, kind)
    if which == "triton" and h.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"loss_impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {h.device}; "
                         "use 'torch'")
    need_grad = torch.is_grad_enabled() and (h.requires_grad or Wd.requires_grad)
    dev = h.device.type
    compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    loss, row, arg, tgt = _ChunkedDistill.apply(h, Wd, ht, Wt, row_scale.detach(), kind, int(chunk_rows),
                                                which == "triton", need_grad, compute_dtype)
    return DistillOutput(loss, row, arg, tgt)


__all__ = ["DistillOutput", "LossImpl", "linear_distill_loss", "plain_distill_loss", "resolve_loss_impl",
           "triton_available"]
