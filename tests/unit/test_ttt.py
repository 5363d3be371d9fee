"""EAGLE-3 training-time test objective on a tiny random head."""

import pytest
import torch

from peagle_core.drafter_cache import DrafterCache
from peagle_core.objectives import build_objective
from peagle_core.objectives.eagle3 import build_ttt_elements, ttt_forward
from tests.unit.test_objective import one_doc, target_head, tiny_head, tiny_pack

pytestmark = pytest.mark.unit


def test_ttt_elements_shift_tokens_and_positions():
    b = one_doc(6)
    el = build_ttt_elements(b, 3)
    x = b.input_ids.tolist()
    step2 = el.index(slice(12, 18))
    assert step2.depth.tolist() == [2] * 6
    assert step2.position.tolist() == [2, 3, 4, 5, 6, 7]
    assert step2.input_ids.tolist()[:3] == [x[3], x[4], x[5]]  # token x[a+1+i]
    assert step2.valid.tolist() == [True, True, True, False, False, False]
    assert step2.loss.tolist() == [True, True, False, False, False, False]  # label x[a+4] exists for a <= 1


def test_ttt_slots_equal_sequential_drafting_with_cache():
    """Slot (a, i) of TTT = the i-th sequential draft step from anchor a (vLLM's EAGLE-3 loop),
    with the ground-truth token fed instead of the drafted one."""
    head = tiny_head(mask_token_id=None).eval()
    b = one_doc(9)
    T = 4
    el = build_ttt_elements(b, T)
    with torch.no_grad():
        outs = {i: normed for i, _, normed in ttt_forward(head, b, el, T, attention="dense")}
        for a in (0, 3, 4):
            cache = DrafterCache(2)
            x = b.input_ids
            normed, prenorm = head(x[1:a + 2][None], head.combine_hidden_states(b.aux[:a + 1])[None],
                                   b.position_ids[:a + 1][None], cache=cache)
            torch.testing.assert_close(normed[0, -1], outs[0][a], rtol=1e-5, atol=1e-5)
            h = prenorm[:, -1:]
            for i in range(1, T):
                normed, h = head(x[a + 1 + i].view(1, 1), h, torch.tensor([[a + i]]), cache=cache)
                torch.testing.assert_close(normed[0, 0], outs[i][a], rtol=1e-5, atol=1e-5)


def test_ttt_loss_weights_finite_and_decreases():
    head = tiny_head(mask_token_id=None)
    batch = tiny_pack((12, 10, 9), max_tokens=64)
    obj = build_objective("eagle3", num_steps=7, attention="dense")
    assert obj.step_weights == pytest.approx([0.8**i for i in range(7)])
    with torch.no_grad():
        loss, m = obj.compute_loss(head, batch, target_lm_head=target_head())
    assert torch.isfinite(loss) and loss > 0
    n0 = m["count_d0"]
    recombined = sum(0.8**i * m[f"loss_d{i}"] * m[f"count_d{i}"] for i in range(7)) / n0
    assert float(loss) == pytest.approx(recombined, rel=1e-5)
    assert m["count_d6"] < m["count_d0"]  # labels run out near document ends

    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        losses.append(obj.forward_backward(head, batch, target_lm_head=target_head())["loss"])
        opt.step()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.9 * losses[0], losses


def test_ttt_backward_matches_autograd_reference():
    head = tiny_head(mask_token_id=None)
    batch = tiny_pack((8, 7), max_tokens=32)
    ref = build_objective("eagle3", num_steps=3, attention="dense", loss_impl="plain")
    loss, _ = ref.compute_loss(head, batch, target_lm_head=target_head())
    loss.backward()
    g_ref = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad(set_to_none=True)
    build_objective("eagle3", num_steps=3, attention="dense", loss_impl="torch", loss_chunk_rows=5).forward_backward(
        head, batch, target_lm_head=target_head())
    for n, p in head.named_parameters():
        assert (p.grad - g_ref[n]).norm() <= 1e-5 * g_ref[n].norm(), n


def test_ttt_flex_step_masks_give_the_dense_loss():
    """Flex: N = 150 slots per step (not a multiple of 128) run as 256 with fillers, every step's mask
    cut from one block mask over all steps; loss and per-step accuracies equal the dense path's
    (forward only: flex backward is CUDA-only in this torch)."""
    head = tiny_head(mask_token_id=None).eval()
    batch = tiny_pack((70, 50, 30), max_tokens=256)
    assert batch.num_tokens % 128
    with torch.no_grad():
        dense, md = build_objective("eagle3", num_steps=4, attention="dense").compute_loss(
            head, batch, target_lm_head=target_head())
        flex, mf = build_objective("eagle3", num_steps=4, attention="flex").compute_loss(
            head, batch, target_lm_head=target_head())
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)
    assert [md[f"acc_d{i}"] for i in range(4)] == [mf[f"acc_d{i}"] for i in range(4)]


def test_query_block_slice_rejects_a_cut_attended_key():
    from peagle_core.masks import flex_element_mask, query_block_slice

    el = build_ttt_elements(one_doc(128), 2)  # 2 steps of 128 slots; step 1 attends step-1 keys
    whole = flex_element_mask(el)
    assert query_block_slice(whole, 128, 128, 256).seq_lengths == (128, 256)
    with pytest.raises(ValueError, match="attend keys at or after 128"):
        query_block_slice(whole, 128, 128, 128)
    with pytest.raises(ValueError, match="multiples of 128"):
        query_block_slice(whole, 0, 100, 128)


def test_ttt_rejects_parallel_head():
    with pytest.raises(ValueError, match="mask_token_id=None"):
        build_objective("eagle3").compute_loss(tiny_head(), one_doc(5), target_lm_head=target_head())


def test_trained_eagle3_head_exports_in_vllm_format(tmp_path):
    from peagle_core.contract import export_head, load_head, validate_head

    head = tiny_head(mask_token_id=None)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    build_objective("eagle3", num_steps=2, attention="dense").forward_backward(
        head, tiny_pack((8, 7), max_tokens=32), target_lm_head=target_head())
    opt.step()
    out = export_head(head, tmp_path / "head", dtype="float32")
    validate_head(out, parallel_drafting=False)
    loaded = load_head(out)
    assert not loaded.parallel_drafting
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)
