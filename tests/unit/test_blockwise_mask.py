"""peagle_core.masks.blockwise_block_tables: the block tables create_block_mask computes (partial and full
blocks, their order), built without create_block_mask, for self-attention of P-EAGLE elements, a segment of
Algorithm 1 (keys-only context plus own slots), cross-attention with a diagonal and lengths that are not whole
blocks; EAGLE-3's step masks and the P-EAGLE loss are the same with either build."""

import pytest
import torch

from peagle_core.elements import build_peagle_elements, forward_order, pad_elements
from peagle_core.masks import flex_element_mask
from peagle_core.objectives.eagle3 import build_ttt_elements, ttt_flex_step_masks
from peagle_core.partition import partition_elements
from tests.unit.test_objective import MASK_ID, _loss, tiny_head, tiny_pack

pytestmark = pytest.mark.unit

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _elements(lengths=(300, 90, 500), k=4, seed=0):
    b = tiny_pack(lengths, max_tokens=sum(lengths))
    return b, build_peagle_elements(b, k, MASK_ID, cod_ratio=0.6, generator=torch.Generator().manual_seed(seed))


def _same_tables(a, b):
    for name in TABLES:
        x, y = getattr(a, name), getattr(b, name)
        if name.endswith("indices"):  # only each row's used entries carry meaning
            num = getattr(a, name.replace("indices", "num_blocks"))
            used = torch.arange(x.shape[-1]) < num[..., None]
            x, y = x.masked_fill(~used, -1), y.masked_fill(~used, -1)
        assert torch.equal(x, y), name
    assert a.seq_lengths == b.seq_lengths
    assert torch.equal(a.to_dense(), b.to_dense())


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_self_attention_tables_equal_create_block_mask(rows, monkeypatch):
    monkeypatch.setattr("peagle_core.masks.BLOCKWISE_ROWS", rows)
    _, el = _elements()
    el = el.index(forward_order(el, 4))
    assert el.num_elements % 128  # a partial last block
    got = flex_element_mask(el, build="blockwise")
    assert got.kv_num_blocks.sum() > 0 and got.full_kv_num_blocks.sum() > 0  # both kinds of tile occur
    _same_tables(got, flex_element_mask(el, compile=False))


def test_a_segments_tables_equal_create_block_mask():
    b, el = _elements(seed=1)
    for seg in partition_elements(el, 2, num_anchors=b.num_tokens):
        e = el.index(seg.indices)
        e = e.index(forward_order(e, 4))
        _same_tables(flex_element_mask(e, build="blockwise"), flex_element_mask(e, compile=False))


def test_cross_attention_with_a_diagonal_equals_create_block_mask():
    _, el = _elements(seed=2)
    q = el.index(torch.arange(200, el.num_elements))
    got = flex_element_mask(q, el, diagonal=200, build="blockwise")
    _same_tables(got, flex_element_mask(q, el, diagonal=200, compile=False))


def test_an_unknown_build_is_named():
    _, el = _elements()
    with pytest.raises(ValueError, match="build='fast'"):
        flex_element_mask(el, build="fast")


def test_eagle3_ttt_masks_are_the_same_with_either_build():
    b = tiny_pack((200, 90), max_tokens=290)
    el = build_ttt_elements(b, 3)
    N, Np = b.num_tokens, 384
    steps = [pad_elements(el.index(slice(i * N, (i + 1) * N)), Np) for i in range(3)]
    for a, c in zip(ttt_flex_step_masks(steps, build="blockwise"), ttt_flex_step_masks(steps), strict=True):
        assert torch.equal(a.to_dense(), c.to_dense())


def test_the_loss_is_the_same_with_either_build():
    head, b = tiny_head(), tiny_pack()
    compiled, _ = _loss(head, b, num_depths=4, cod_ratio=0.7, attention="flex", loss_impl="torch")
    blockwise, _ = _loss(head, b, num_depths=4, cod_ratio=0.7, attention="flex", loss_impl="torch",
                         block_mask="blockwise")
    torch.testing.assert_close(blockwise, compiled, rtol=0, atol=0)
