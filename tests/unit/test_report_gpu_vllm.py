"""bench.report_gpu_vllm: a lease is named with the GPU its rows record."""

from bench import report_gpu_vllm as rg


def test_lease_names_the_rows_gpu_where_recorded():
    assert rg._lease({"date": "2026-11-26", "device": "NVIDIA H200"}) == "2026-11-26 (H200)"
    assert rg._lease({"date": "2026-11-24", "lease": "2026-11-24 20:10 UTC"}) == "2026-11-24 20:10 UTC"
