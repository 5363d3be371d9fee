"""bench.report: every committed result file renders (a result a reading does not expect, e.g. an EAGLE-3 head
evaluated at fewer K than its P-EAGLE mate, must not stop the report), and docs/benchmarks.md is what the committed
results generate."""

from pathlib import Path

from bench import report, report_scale

DOC = Path(report.DOC)


def test_the_committed_results_generate_the_committed_doc(tmp_path, monkeypatch):
    out = tmp_path / "docs" / "benchmarks.md"
    monkeypatch.setattr(report, "DOC", out)
    monkeypatch.setattr(report_scale, "DOC", out)  # the plots go beside it
    report.main()
    assert out.read_text() == DOC.read_text(), "docs/benchmarks.md is stale: run python -m bench.report"
