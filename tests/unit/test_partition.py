"""Sequence partition (P-EAGLE Algorithm 1): segments and gradient equality with one pass."""

import contextlib

import pytest
import torch

from peagle_core.elements import build_peagle_elements
from peagle_core.objectives import build_objective
from peagle_core.partition import partition_elements, segment_boundaries
from tests.unit.test_objective import MASK_ID, one_doc, target_head, tiny_head, tiny_pack

pytestmark = pytest.mark.unit


def test_segment_boundaries():
    assert segment_boundaries(10, 1) == [0, 10]
    assert segment_boundaries(10, 4) == [0, 2, 5, 7, 10]
    assert segment_boundaries(3, 7) == [0, 0, 0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_partitions"):
        segment_boundaries(10, 0)


def test_segments_written_out_n5_k3():
    # Elements of N=5, K=3 (see test_objective): (0,0) (1,0) (0,1) (0,2) (2,0) (1,1) (3,0)
    el = build_peagle_elements(one_doc(5), 3, MASK_ID)
    segs = partition_elements(el, 2, num_anchors=5)  # boundaries 0, 2, 5
    assert [(s.lo, s.hi, s.start, s.end) for s in segs] == [(0, 2, 0, 4), (2, 5, 4, 7)]
    # segment 0 owns anchors {0, 1} at depth 0 and anchor 0 at depths >= 1 (key a+1 = 1)
    assert [el.as_tuples()[i] for i in segs[0].indices.tolist()] == [(0, 0), (1, 0), (0, 1), (0, 2)]
    # segment 1 recomputes the depth-0 context (0,0), (1,0), then owns (2,0) (1,1) (3,0)
    assert segs[1].context.tolist() == [0, 1]
    assert [el.as_tuples()[i] for i in segs[1].indices.tolist()] == [(0, 0), (1, 0), (2, 0), (1, 1), (3, 0)]


def _grads(head, S, batch, seed=0, no_sync=None, depth_decay=1.0):
    head.zero_grad(set_to_none=True)
    obj = build_objective("peagle", num_depths=4, cod_ratio=0.7, cod_min_ratio=0.2, num_partitions=S,
                          attention="dense", loss_impl="torch", loss_chunk_rows=7, seed=seed,
                          depth_decay=depth_decay)
    m = obj.forward_backward(head, batch, target_lm_head=target_head(), no_sync=no_sync)
    return m, {n: p.grad.clone() for n, p in head.named_parameters()}


def _reference_grads(head, batch, seed=0, depth_decay=1.0):
    """Single pass through plain autograd (materialized logits) with the same COD draw."""
    head.zero_grad(set_to_none=True)
    obj = build_objective("peagle", num_depths=4, cod_ratio=0.7, cod_min_ratio=0.2, attention="dense",
                          loss_impl="plain", seed=seed, depth_decay=depth_decay)
    loss, m = obj.compute_loss(head, batch, target_lm_head=target_head())
    loss.backward()
    return m, {n: p.grad.clone() for n, p in head.named_parameters()}


@pytest.mark.parametrize("S,depth_decay", [(1, 1.0), (2, 1.0), (4, 1.0), (7, 1.0), (4, 0.5)])
def test_partition_gradients_equal_single_pass(S, depth_decay):
    torch.manual_seed(0)
    head = tiny_head()
    batch = tiny_pack((9, 7, 11, 6), max_tokens=64)  # 4 documents, 33 tokens
    m1, g1 = _reference_grads(head, batch, depth_decay=depth_decay)
    mS, gS = _grads(head, S, batch, depth_decay=depth_decay)
    assert m1["num_loss_elements"] == mS["num_loss_elements"] > 0
    assert 0 < m1["count_d3"] < m1["count_d1"] < m1["count_d0"]  # COD really dropped elements
    assert abs(m1["loss"] - mS["loss"]) <= 1e-5 * abs(m1["loss"])
    for name, g in g1.items():
        assert g.abs().sum() > 0, name
        rel = (gS[name] - g).norm() / g.norm()
        assert rel < 1e-5, f"{name}: relative error {rel:.2e} with S={S}"
    if S > 1:  # the work really was split: more forward slots (recomputed context) than one pass
        assert mS["num_forward_slots"] > m1["num_forward_slots"]


def test_no_sync_wraps_all_but_last_backward():
    head = tiny_head()
    batch = tiny_pack((9, 7, 11, 6), max_tokens=64)
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append(True)
        yield

    obj = build_objective("peagle", num_depths=3, num_partitions=4, attention="dense")
    obj.forward_backward(head, batch, target_lm_head=target_head(), no_sync=no_sync)
    assert len(entered) == 3  # 4 segments with loss elements, the last backward syncs
