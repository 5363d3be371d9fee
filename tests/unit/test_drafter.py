import pytest
import torch

from peagle_core.drafter_cache import DrafterCache, last_valid_index
from peagle_core.drafter_config import DrafterConfig, default_aux_layer_ids

from .conftest import MASK_ID, make_drafter, tiny_target_config

pytestmark = pytest.mark.unit


def test_default_aux_layer_ids_follow_vllm():
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(5) == (2, 2, 2)
    with pytest.raises(ValueError, match="num_target_layers=3"):
        default_aux_layer_ids(3)


def test_forward_shapes(tiny_drafter):
    B, T = 2, 7
    ids = torch.randint(0, 99, (B, T))
    aux = torch.randn(B, T, 3 * 36)
    pos = torch.arange(T).expand(B, T)
    normed, prenorm = tiny_drafter(ids, tiny_drafter.combine_hidden_states(aux), pos)
    assert normed.shape == prenorm.shape == (B, T, 36)
    assert tiny_drafter.compute_logits(normed).shape == (B, T, 99)
    assert tiny_drafter.mask_slot_hidden().shape == (36,)


@pytest.mark.parametrize("split", [1, 3, 6])
def test_kv_cache_equals_no_cache(tiny_drafter, split):
    B, T = 2, 7
    torch.manual_seed(3)
    ids, aux = torch.randint(0, 99, (B, T)), torch.randn(B, T, 108)
    pos = torch.arange(T).expand(B, T)
    h = tiny_drafter.combine_hidden_states(aux)
    full, _ = tiny_drafter(ids, h, pos)
    cache = DrafterCache(2)
    a, _ = tiny_drafter(ids[:, :split], h[:, :split], pos[:, :split], cache=cache)
    b, _ = tiny_drafter(ids[:, split:], h[:, split:], pos[:, split:], cache=cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-5, atol=1e-6)
    assert cache.length == T


def test_parallel_slots_hand_checked_k3(tiny_drafter):
    """K=3: the single forward sees [real slots..., mask, mask] at positions [.., a+1, a+2]."""
    seen = {}
    orig = tiny_drafter.forward

    def spy(input_ids, hidden, position_ids, **kw):
        seen.update(ids=input_ids.clone(), hidden=hidden.clone(), pos=position_ids.clone())
        return orig(input_ids, hidden, position_ids, **kw)

    tiny_drafter.forward = spy
    ids = torch.tensor([[11, 12, 13, 14]])
    aux = torch.randn(1, 4, 108)
    pos = torch.tensor([[5, 6, 7, 8]])
    cache = DrafterCache(2)
    out = tiny_drafter.draft_parallel(ids, aux, pos, 3, cache)
    assert out.shape == (1, 3)
    assert seen["ids"].tolist() == [[11, 12, 13, 14, MASK_ID, MASK_ID]]
    assert seen["pos"].tolist() == [[5, 6, 7, 8, 9, 10]]
    mh = tiny_drafter.mask_slot_hidden()
    torch.testing.assert_close(seen["hidden"][0, 4], mh)
    torch.testing.assert_close(seen["hidden"][0, 5], mh)
    torch.testing.assert_close(seen["hidden"][0, :4], tiny_drafter.combine_hidden_states(aux)[0])
    assert cache.length == 4  # mask slots cropped


def test_parallel_equals_dense_forward_argmax(tiny_drafter):
    """Parallel drafting's K tokens equal the argmax of one causal forward over the K-slot input."""
    ids = torch.tensor([[3, 4, 5]])
    aux = torch.randn(1, 3, 108)
    pos = torch.tensor([[0, 1, 2]])
    got = tiny_drafter.draft_parallel(ids, aux, pos, 4, DrafterCache(2))
    h = torch.cat([tiny_drafter.combine_hidden_states(aux), tiny_drafter.mask_slot_hidden().expand(1, 3, -1)], 1)
    full_ids = torch.tensor([[3, 4, 5, MASK_ID, MASK_ID, MASK_ID]])
    normed, _ = tiny_drafter(full_ids, h, torch.arange(6)[None])
    want = tiny_drafter.compute_logits(normed[:, 2:]).argmax(-1)
    assert got.tolist() == want.tolist()


def test_sequential_feeds_back_prenorm(tiny_drafter):
    ids, aux, pos = torch.tensor([[3, 4, 5]]), torch.randn(1, 3, 108), torch.tensor([[0, 1, 2]])
    got = tiny_drafter.draft_sequential(ids, aux, pos, 3, DrafterCache(2))
    # Reference without cache: re-run the whole sequence each step.
    h = tiny_drafter.combine_hidden_states(aux)
    seq_ids, seq_h, toks = ids, h, []
    for k in range(3):
        normed, prenorm = tiny_drafter(seq_ids, seq_h, torch.arange(seq_ids.shape[1])[None])
        tok = tiny_drafter.compute_logits(normed[:, -1]).argmax(-1)
        toks.append(int(tok))
        seq_ids = torch.cat([seq_ids, tok[:, None]], 1)
        seq_h = torch.cat([seq_h, prenorm[:, -1:]], 1)
    assert got.tolist() == [toks]


def test_padding_rows_match_unpadded(tiny_drafter):
    aux = torch.randn(2, 4, 108)
    ids = torch.tensor([[0, 7, 8, 9], [6, 7, 8, 9]])
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    pos = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]])
    both = tiny_drafter.draft_parallel(ids, aux, pos, 3, DrafterCache(2), query_valid=valid)
    alone = tiny_drafter.draft_parallel(ids[:1, 1:], aux[:1, 1:], pos[:1, 1:], 3, DrafterCache(2))
    assert both[0].tolist() == alone[0].tolist()


def test_last_valid_index_left_and_right_padding():
    v = torch.tensor([[True, True, False], [False, True, True]])
    assert last_valid_index(v).tolist() == [1, 2]
    with pytest.raises(ValueError):
        last_valid_index(torch.tensor([[False, False]]))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"aux_layer_ids": (2, 3, 5)}, "aux_layer_ids"),
        ({"mask_token_id": 99}, "mask_token_id"),
        ({"draft_vocab_size": 100}, "draft_vocab_size"),
        ({"aux_layer_ids": (1, 2)}, "exactly 3"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        DrafterConfig.from_target(tiny_target_config(), **kw)


def test_eagle3_head_cannot_draft_in_parallel():
    d = make_drafter(mask_token_id=None)
    assert not d.parallel_drafting
    with pytest.raises(ValueError, match="mask_hidden"):
        d.mask_slot_hidden()


def test_options_change_maths():
    base = make_drafter()
    ids, aux, pos = torch.randint(0, 99, (1, 5)), torch.randn(1, 5, 108), torch.arange(5)[None]
    ref, _ = base(ids, base.combine_hidden_states(aux), pos)
    for opt in ("norm_before_residual", "norm_before_fc", "fc_norm", "attention_bias"):
        d = make_drafter(**{opt: True})
        with torch.no_grad():
            for name, p in d.named_parameters():
                if name in dict(base.named_parameters()) and p.shape == dict(base.named_parameters())[name].shape:
                    p.copy_(dict(base.named_parameters())[name])
            for n, p in d.named_parameters():
                if "norm" in n and n not in dict(base.named_parameters()):
                    p.fill_(1.3)
                if n.endswith("bias"):
                    p.fill_(0.1)
        out, _ = d(ids, d.combine_hidden_states(aux), pos)
        assert not torch.allclose(out, ref), opt
