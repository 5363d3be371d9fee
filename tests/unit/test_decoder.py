import pytest
import torch

from peagle_core.decoder import speculative_generate

from .conftest import make_drafter

pytestmark = pytest.mark.unit

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
@pytest.mark.parametrize("K", [1, 3, 5])
def test_lossless_against_target_greedy(tiny_target, method, K):
    ref = speculative_generate(tiny_target, PROMPTS, method="none", max_new_tokens=24)
    d = make_drafter(mask_token_id=97 if method == "peagle" else None)
    got = speculative_generate(tiny_target, PROMPTS, drafter=d, method=method, num_speculative_tokens=K,
                               max_new_tokens=24)
    assert got.output_ids == ref.output_ids
    assert got.num_draft_tokens == K * got.num_drafts


def test_none_equals_hf_generate(tiny_target):
    ref = speculative_generate(tiny_target, PROMPTS, method="none", max_new_tokens=12)
    for p, out in zip(PROMPTS, ref.output_ids):
        ids = torch.tensor([p])
        g = tiny_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert g[0, len(p):].tolist() == out


def test_all_accepted_bookkeeping(tiny_target):
    """A target that always emits token 0 and a drafter that always drafts 0: every draft accepted."""
    with torch.no_grad():
        tiny_target.lm_head.weight.zero_()
    d = make_drafter()
    with torch.no_grad():
        d.norm.weight.zero_()  # all draft logits 0 -> argmax draft id 0 -> target id 0 + d2t[0] = 0
    K = 4
    res = speculative_generate(tiny_target, PROMPTS, drafter=d, method="peagle", num_speculative_tokens=K,
                               max_new_tokens=21)
    assert all(o == [0] * 21 for o in res.output_ids)
    # 1 token from prefill, then 5 per step -> 4 steps per sequence, each fully accepted.
    assert res.num_drafts == 3 * 4
    assert res.accepted_per_pos == [res.num_drafts] * K
    assert res.acceptance_length == pytest.approx(1 + K)


def test_eos_stops_each_row(tiny_target):
    ref = speculative_generate(tiny_target, PROMPTS, method="none", max_new_tokens=24)
    eos = ref.output_ids[0][3]
    got = speculative_generate(tiny_target, PROMPTS, drafter=make_drafter(), method="peagle",
                               num_speculative_tokens=3, max_new_tokens=24, eos_token_id=eos)
    for r, g in zip(ref.output_ids, got.output_ids):
        cut = r.index(eos) + 1 if eos in r else len(r)
        assert g == r[:cut]


def test_errors(tiny_target):
    with pytest.raises(ValueError, match="method"):
        speculative_generate(tiny_target, PROMPTS, method="medusa")
    with pytest.raises(ValueError, match="needs a drafter"):
        speculative_generate(tiny_target, PROMPTS, method="peagle")
    with pytest.raises(ValueError, match="mask_hidden"):
        speculative_generate(tiny_target, PROMPTS, drafter=make_drafter(mask_token_id=None), method="peagle")
    with pytest.raises(ValueError, match="at least one token"):
        speculative_generate(tiny_target, [[]], method="none")


@pytest.mark.parametrize("method", ["parallel", "sequential"])
@pytest.mark.parametrize("K", [1, 4])
def test_static_cache_drafts_like_the_dynamic_cache(method, K):
    """bench.drafting_cost times CUDA graphs on StaticDrafterCache: it must draft what DrafterCache does,
    step after step (speculative slots overwritten, committed ones kept)."""
    from bench.drafting_cost import StaticDrafterCache, prefilled_cache, step_fn

    d = make_drafter(mask_token_id=97 if method == "parallel" else None).float()
    dyn = prefilled_cache(d, 3, 13, "cpu", torch.float32)
    static = StaticDrafterCache(dyn, room=K + 1)
    a, b = [], []
    for _ in range(2):
        step_fn(d, dyn, method, K, 3, 13, "cpu", torch.float32, out=a)()
        step_fn(d, static, method, K, 3, 13, "cpu", torch.float32, out=b)()
        assert torch.equal(a[0], b[0])
        assert dyn.length == static.length == 13
    assert not static.key_valid[:, 13:].any()


def test_batch_size_sums_the_batches(tiny_target):
    d = make_drafter(mask_token_id=97)
    kw = {"drafter": d, "method": "peagle", "num_speculative_tokens": 3, "max_new_tokens": 16}
    got = speculative_generate(tiny_target, PROMPTS, batch_size=2, **kw)
    parts = [speculative_generate(tiny_target, PROMPTS[:2], **kw), speculative_generate(tiny_target, PROMPTS[2:], **kw)]
    assert got.output_ids == parts[0].output_ids + parts[1].output_ids
    assert got.num_drafts == sum(p.num_drafts for p in parts) > 0
    assert got.num_accepted_tokens == sum(p.num_accepted_tokens for p in parts)
    assert got.accepted_per_pos == [a + b for a, b in zip(parts[0].accepted_per_pos, parts[1].accepted_per_pos)]
    assert got.num_steps == sum(p.num_steps for p in parts)
    with pytest.raises(ValueError, match="batch_size"):
        speculative_generate(tiny_target, PROMPTS, batch_size=0, **kw)
    with pytest.raises(ValueError, match="at least one token"):  # a bad prompt in a later batch: before decoding
        speculative_generate(tiny_target, [*PROMPTS, []], batch_size=1, **kw)
