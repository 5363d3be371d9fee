import pytest
import torch

from peagle_core.vocab import target_to_draft_ids, vocab_mapping_from_counts

pytestmark = pytest.mark.unit


def test_top_n_with_offsets_hand_checked():
    counts = torch.tensor([5, 0, 9, 1, 9, 3])
    d2t, t2d = vocab_mapping_from_counts(counts, 3)
    # kept target ids: 2, 4 (9 each), 0 (5) -> ascending [0, 2, 4]
    assert t2d.tolist() == [True, False, True, False, True, False]
    assert d2t.tolist() == [0, 1, 2]  # target = draft + d2t -> 0, 2, 4
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 4]
    assert target_to_draft_ids(t2d).tolist() == [0, -1, 1, -1, 2, -1]


def test_always_keep_and_ties():
    _d2t, t2d = vocab_mapping_from_counts(torch.tensor([1, 1, 1, 1]), 2, always_keep=[3])
    assert t2d.tolist() == [True, False, False, True]  # tie broken by lowest id


def test_errors():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        vocab_mapping_from_counts(torch.ones(4), 5)
    with pytest.raises(ValueError, match="always_keep"):
        vocab_mapping_from_counts(torch.ones(4), 1, always_keep=[0, 1])
