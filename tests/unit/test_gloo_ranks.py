"""tests.unit.gloo_ranks.spawn_ranks: a second run only after a rank died by a signal."""

import pytest

from tests.unit.gloo_ranks import _abort_in_first_attempt, _raise, spawn_ranks

pytestmark = pytest.mark.unit


def test_spawn_ranks_runs_again_only_after_a_rank_died_by_a_signal(tmp_path):
    import torch.multiprocessing as mp

    with pytest.warns(UserWarning, match="gloo rank 1 died by SIGABRT"):
        out = spawn_ranks(_abort_in_first_attempt, tmp_path / "abort")
    assert out.name == "attempt-2" and {p.name for p in out.iterdir()} == {"rank0", "rank1"}
    with pytest.raises(mp.ProcessRaisedException, match="a wrong value"):
        spawn_ranks(_raise, tmp_path / "raise")
    assert [p.name for p in (tmp_path / "raise").iterdir()] == ["attempt-1"]
