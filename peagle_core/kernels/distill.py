"""Fused Triton kernel for one chunk of the distillation loss (``peagle_core.loss``).

Given the draft logits ``zd [C, Vd]`` and target logits ``zt [C, Vd]`` of a chunk of rows (the
vocabulary projections are cuBLAS matmuls in ``loss._ChunkedDistill``), one program per row
makes one online pass over the vocabulary (running max / sum-exp of both, running
``sum_v exp(zt_v - m_t) (zt_v - zd_v)`` for the KL, running argmaxes) and, when gradients are
needed, a second pass that writes ``dL/dzd = scale * (softmax(zd) - softmax(zt))`` (KL) or
``scale * (softmax(zd) - onehot(argmax zt))`` (CE) over ``zd`` in place. Nothing else of size
``[C, Vd]`` is allocated (the torch path allocates ~5 such temporaries).

KL per row: ``sum_v p_v (log p_v - log q_v) = A / s_t - lse_t + lse_d`` with
``A = sum_v exp(zt_v - m_t) (zt_v - zd_v)``, ``s_t = sum_v exp(zt_v - m_t)``.

Shape legend: C rows of the chunk, Vd draft vocab.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _distill_row_kernel(
    zd_ptr, zt_ptr, scale_ptr, row_ptr, arg_ptr, tgt_ptr,
    V, stride_d, stride_t,
    IS_KL: tl.constexpr, NEED_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    zd_row = zd_ptr + r * stride_d
    zt_row = zt_ptr + r * stride_t
    NEG = float("-inf")
    m_d = tl.full((), NEG, tl.float32)
    s_d = tl.zeros((), tl.float32)
    m_t = tl.full((), NEG, tl.float32)
    s_t = tl.zeros((), tl.float32)
    acc = tl.zeros((), tl.float32)
    best_d = tl.full((), NEG, tl.float32)
    arg_d = tl.zeros((), tl.int64)
    best_t = tl.full((), NEG, tl.float32)
    arg_t = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        msk = offs < V
        zd = tl.load(zd_row + offs, mask=msk, other=NEG).to(tl.float32)
        zt = tl.load(zt_row + offs, mask=msk, other=NEG).to(tl.float32)
        # argmaxes (first index on ties, like torch.argmax)
        bd = tl.max(zd, 0)
        id_ = tl.argmax(zd, 0).to(tl.int64) + start
        upd = bd > best_d
        arg_d = tl.where(upd, id_, arg_d)
        best_d = tl.where(upd, bd, best_d)
        bt = tl.max(zt, 0)
        it = tl.argmax(zt, 0).to(tl.int64) + start
        upt = bt > best_t
        arg_t = tl.where(upt, it, arg_t)
        best_t = tl.where(upt, bt, best_t)
        # online logsumexp of zd
        new_md = tl.maximum(m_d, bd)
        s_d = s_d * tl.exp(m_d - new_md) + tl.sum(tl.where(msk, tl.exp(zd - new_md), 0.0), 0)
        m_d = new_md
        # online logsumexp of zt and the KL accumulator
        new_mt = tl.maximum(m_t, bt)
        alpha = tl.exp(m_t - new_mt)
        et = tl.where(msk, tl.exp(zt - new_mt), 0.0)
        s_t = s_t * alpha + tl.sum(et, 0)
        if IS_KL:
            acc = acc * alpha + tl.sum(tl.where(msk, et * (zt - zd), 0.0), 0)
        m_t = new_mt
    lse_d = m_d + tl.log(s_d)
    lse_t = m_t + tl.log(s_t)
    if IS_KL:
        loss = acc / s_t - lse_t + lse_d
    else:
        zd_at = tl.load(zd_row + arg_t).to(tl.float32)
        loss = lse_d - zd_at
    tl.store(row_ptr + r, loss)
    tl.store(arg_ptr + r, arg_d)
    tl.store(tgt_ptr + r, arg_t)
    if NEED_GRAD:
        scale = tl.load(scale_ptr + r)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            msk = offs < V
            zd = tl.load(zd_row + offs, mask=msk, other=0.0).to(tl.float32)
            q = tl.exp(zd - lse_d)
            if IS_KL:
                zt = tl.load(zt_row + offs, mask=msk, other=0.0).to(tl.float32)
                g = q - tl.exp(zt - lse_t)
            else:
                g = q - tl.where(offs == arg_t, 1.0, 0.0)
            tl.store(zd_row + offs, (g * scale).to(zd_ptr.dtype.element_ty), mask=msk)


def chunk_distill_triton(zd: torch.Tensor, zt: torch.Tensor, scale: torch.Tensor, kind: str, need_grad: bool,
                         block_v: int = 2048):
    """Triton version of ``loss._chunk_torch``: ``(row_loss [C] fp32, dzd (= zd, overwritten) or None,
    draft_argmax [C], target_argmax [C])``. ``zd`` is overwritten with the gradient when
    ``need_grad``; both inputs must have a contiguous last dimension."""
    C, V = zd.shape
    if zd.stride(1) != 1 or zt.stride(1) != 1:
        zd, zt = zd.contiguous(), zt.contiguous()
    row = torch.empty(C, dtype=torch.float32, device=zd.device)
    arg = torch.empty(C, dtype=torch.int64, device=zd.device)
    tgt = torch.empty(C, dtype=torch.int64, device=zd.device)
    scale = scale.float().contiguous()
    block = min(block_v, triton.next_power_of_2(V))
    if C:
        _distill_row_kernel[(C,)](zd, zt, scale, row, arg, tgt, V, zd.stride(0), zt.stride(0),
                                  IS_KL=kind == "kl", NEED_GRAD=need_grad, BLOCK_V=block)
    return row, (zd if need_grad else None), arg, tgt
