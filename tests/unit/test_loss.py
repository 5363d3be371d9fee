"""Distillation loss through the vocabulary projection: chunked torch and fused Triton vs plain.

On a CUDA box: ``python -m pytest tests/unit/test_loss.py`` runs the Triton tests too. Without
CUDA they are skipped, unless triton is importable and ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter; slow, small shapes only).
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peagle_core.loss import linear_distill_loss, plain_distill_loss

pytestmark = pytest.mark.unit

M, H, HT, VD = 23, 36, 20, 99


def _inputs(device="cpu", dtype=torch.float32, seed=0, m=M, vd=VD):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(m, H, generator=g)).to(device, dtype).requires_grad_()
    Wd = (torch.randn(vd, H, generator=g) * 0.3).to(device, dtype).requires_grad_()
    ht = torch.randn(m, HT, generator=g).to(device, dtype)
    Wt = (torch.randn(vd, HT, generator=g) * 0.5).to(device, dtype)
    scale = (torch.rand(m, generator=g) + 0.5).to(device)
    return h, Wd, ht, Wt, scale


def _value_and_grads(impl, kind, chunk_rows=1024, **kw):
    h, Wd, ht, Wt, scale = _inputs(**kw)
    out = linear_distill_loss(h, Wd, ht, Wt, row_scale=scale, kind=kind, impl=impl, chunk_rows=chunk_rows)
    out.loss.backward()
    return out, h.grad, Wd.grad


@pytest.mark.parametrize("kind", ["kl", "ce"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_chunked_torch_equals_plain(kind, chunk_rows):
    ref, gh_ref, gW_ref = _value_and_grads("plain", kind)
    out, gh, gW = _value_and_grads("torch", kind, chunk_rows=chunk_rows)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.row_loss, ref.row_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.draft_argmax, ref.draft_argmax) and torch.equal(out.target_argmax, ref.target_argmax)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-6)  # summation order differs per chunking
    torch.testing.assert_close(gW, gW_ref, rtol=1e-5, atol=1e-6)
    assert (ref.row_loss >= -1e-6).all()


def test_upstream_gradient_scales_and_no_grad_path():
    h, Wd, ht, Wt, scale = _inputs()
    out = linear_distill_loss(h, Wd, ht, Wt, row_scale=scale, impl="torch", chunk_rows=5)
    (3.0 * out.loss).backward()
    h2 = h.detach().requires_grad_()
    torch.autograd.backward(3.0 * plain_distill_loss(h2, Wd.detach(), ht, Wt, scale).loss)
    # Chunked and plain sum the vocabulary in a different order: float32 rounding (eps 1.2e-7 times the
    # gradient's magnitude, ~1) differs per machine and BLAS, so atol is a few eps, as in the test above.
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        nog = linear_distill_loss(h, Wd, ht, Wt, row_scale=scale, impl="torch", chunk_rows=5)
    torch.testing.assert_close(nog.loss, out.loss.detach())


def test_kl_is_zero_when_draft_equals_target():
    h, Wd, _, _, scale = _inputs()
    with torch.no_grad():
        out = linear_distill_loss(h, Wd, h, Wd, row_scale=scale, impl="torch", chunk_rows=4)
    assert out.row_loss.abs().max() < 1e-5
    assert torch.equal(out.draft_argmax, out.target_argmax)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_chunked_never_materializes_full_logits():
    m, vd = 64, 500
    h, Wd, ht, Wt, scale = _inputs(m=m, vd=vd)
    with _LargestTensor() as mode:
        out = linear_distill_loss(h, Wd, ht, Wt, row_scale=scale, impl="torch", chunk_rows=8)
        out.loss.backward()
    assert mode.max_numel <= max(8 * vd, vd * H) < m * vd  # one [chunk_rows, Vd] chunk or dWd [Vd, H]
    with _LargestTensor() as mode:
        plain_distill_loss(h, Wd, ht, Wt, scale)
    assert mode.max_numel == m * vd  # the reference does materialize it (so the probe works)


def test_bad_shapes_raise():
    h, Wd, ht, Wt, scale = _inputs()
    with pytest.raises(ValueError, match="Wd"):
        linear_distill_loss(h, Wd[:, :5], ht, Wt)
    with pytest.raises(ValueError, match="row_scale"):
        linear_distill_loss(h, Wd, ht, Wt, row_scale=scale[:3])
    with pytest.raises(ValueError, match="kind"):
        linear_distill_loss(h, Wd, ht, Wt, kind="mse")


# --- Triton (CUDA; or TRITON_INTERPRET=1 on CPU) ------------------------------------------------


def _triton_device():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return None


TRITON_DEVICE = _triton_device()
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason="needs CUDA + triton (or TRITON_INTERPRET=1)")


@needs_triton
@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_triton_chunk_kernel_equals_torch(kind):
    from peagle_core.kernels.distill import chunk_distill_triton
    from peagle_core.loss import _chunk_torch

    g = torch.Generator().manual_seed(0)
    zd = (torch.randn(9, 301, generator=g) * 4).to(TRITON_DEVICE)
    zt = (torch.randn(9, 301, generator=g) * 4).to(TRITON_DEVICE)
    scale = torch.rand(9, generator=g).to(TRITON_DEVICE)
    r1, g1, a1, t1 = _chunk_torch(zd.clone(), zt, scale, kind, True)
    r2, g2, a2, t2 = chunk_distill_triton(zd.clone(), zt, scale, kind, True, block_v=64)
    torch.testing.assert_close(r2, r1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
    assert torch.equal(a1, a2) and torch.equal(t1, t2)


@needs_triton
@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_triton_loss_equals_plain(kind):
    ref, gh_ref, gW_ref = _value_and_grads("plain", kind, device=TRITON_DEVICE)
    out, gh, gW = _value_and_grads("triton", kind, chunk_rows=7, device=TRITON_DEVICE)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gW, gW_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 matmuls + large vocab: CUDA only")
def test_triton_bf16_large_vocab_close_to_fp32():
    pytest.importorskip("triton")
    m, vd = 300, 32000
    h, Wd, ht, Wt, scale = _inputs(device="cuda", m=m, vd=vd)
    ref = linear_distill_loss(h, Wd, ht, Wt, row_scale=scale, impl="torch", chunk_rows=128)
    hb, Wdb = h.detach().bfloat16().requires_grad_(), Wd.detach().bfloat16().requires_grad_()
    out = linear_distill_loss(hb, Wdb, ht.bfloat16(), Wt.bfloat16(), row_scale=scale, impl="triton", chunk_rows=128)
    out.loss.backward()
    torch.testing.assert_close(out.loss.float(), ref.loss, rtol=2e-2, atol=1e-2)
    assert torch.isfinite(hb.grad).all() and torch.isfinite(Wdb.grad).all()


def test_bf16_autocast_on_cpu_runs_and_returns_input_dtypes():
    h, Wd, ht, Wt, scale = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_distill_loss(h, Wd, ht, Wt, row_scale=scale, impl="torch", chunk_rows=8)
    out.loss.backward()
    assert h.grad.dtype == torch.float32 and Wd.grad.dtype == torch.float32
    ref = plain_distill_loss(h.detach(), Wd.detach(), ht, Wt, scale)
    torch.testing.assert_close(out.loss, ref.loss, rtol=5e-2, atol=5e-2)
