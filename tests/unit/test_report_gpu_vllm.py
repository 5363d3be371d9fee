"""bench.report_gpu_vllm: a lease is named with the GPU its rows record, two sessions of one day are two leases and
each row's break-even AL is against its own lease's no-speculation row; a speed-up within the spread of repeats
breaks even, it does not pay; a head of the same shape and AL on the same machine is named beside the best."""

from bench import report_gpu_vllm as rg


def test_lease_names_the_rows_gpu_where_recorded():
    assert rg._lease({"date": "2026-11-26", "device": "NVIDIA H200"}) == "2026-11-26 (H200)"
    assert rg._lease({"date": "2026-11-24", "lease": "2026-11-24 20:10 UTC"}) == "2026-11-24 20:10 UTC"


def _row(head: str, session: int, tokens_per_s: float, al: float = 1.0) -> dict:
    return {"head": head, "session": session, "date": "2026-11-26", "device": "NVIDIA H100 80GB HBM3",
            "concurrency": 1, "num_prompts": 32, "acceptance_length": al, "tokens_per_s": tokens_per_s}


def test_two_sessions_of_one_day_are_two_leases():
    # session 4's machine: none at 500 tok/s; session 5's, a slower host: none at 250 tok/s
    rows = [_row("none", 4, 500.0), _row("head", 4, 500.0, al=2.0), _row("none", 5, 250.0)]
    none = rg._none_rows(rows)
    assert none(rows[1]) is rows[0]
    assert rg.break_even_al(rows[1], none(rows[1])) == 2.0  # against its own lease's none, not the slower one (4.0)
    assert rg._lease(rows[0]) != rg._lease(rows[2])


def test_a_speedup_within_the_spread_of_repeats_breaks_even():
    assert rg.verdict(1.001, 1.08).startswith("breaks even at best (within the 1.08x")
    assert rg.verdict(1.2, 1.08) == "pays"
    assert rg.verdict(0.95, 1.08).startswith("breaks even")
    assert rg.verdict(0.70, 1.08) == "does not pay at any measured (K, c)"
    assert rg.verdict(1.001, 1.0) == "pays"


def test_twin_names_a_same_shape_head_of_equal_al_on_the_same_machine_only():
    def row(head, session, tps, al, k=5):
        return _row(head, session, tps, al) | {"K": k, "speedup": tps / 400, "method": head.split("-")[0]}

    best = row("peagle-long", 6, 440.0, 2.61)
    assert "peagle-cod (same method and K, AL 2.60) ran at 0.90x" in rg._twin(best, [best, row("peagle-cod", 6, 360.0, 2.60)])
    others = [row("peagle-cod", 5, 360.0, 2.60),  # another machine
              row("peagle-low", 6, 360.0, 2.20),  # another AL
              row("eagle3-x", 6, 360.0, 2.60),  # another method
              row("peagle-k7", 6, 360.0, 2.60, k=7)]  # another K
    assert rg._twin(best, [best, *others]) == ""
