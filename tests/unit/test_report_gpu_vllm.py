"""bench.report_gpu_vllm: a lease is named with the GPU its rows record; a speed-up within the spread of repeats
breaks even, it does not pay."""

from bench import report_gpu_vllm as rg


def test_lease_names_the_rows_gpu_where_recorded():
    assert rg._lease({"date": "2026-11-26", "device": "NVIDIA H200"}) == "2026-11-26 (H200)"
    assert rg._lease({"date": "2026-11-24", "lease": "2026-11-24 20:10 UTC"}) == "2026-11-24 20:10 UTC"


def test_a_speedup_within_the_spread_of_repeats_breaks_even():
    assert rg.verdict(1.001, 1.08).startswith("breaks even at best (within the 1.08x")
    assert rg.verdict(1.2, 1.08) == "pays"
    assert rg.verdict(0.95, 1.08).startswith("breaks even")
    assert rg.verdict(0.70, 1.08) == "does not pay at any measured (K, c)"
    assert rg.verdict(1.001, 1.0) == "pays"
