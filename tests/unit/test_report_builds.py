"""bench.report: every committed result file renders (a result a reading does not expect, e.g. an EAGLE-3 head
evaluated at fewer K than its P-EAGLE mate, must not stop the report), and docs/benchmarks.md and the README's
results block are what the committed results generate."""

from pathlib import Path

import pytest

from bench import report, report_scale, report_summary
from bench.report_fmt import anchor

pytestmark = pytest.mark.unit

DOC = Path(report.DOC)


def test_the_committed_results_generate_the_committed_doc(tmp_path, monkeypatch):
    out = tmp_path / "docs" / "benchmarks.md"
    readme = tmp_path / "README.md"
    readme.write_text(report_summary.README.read_text())
    monkeypatch.setattr(report, "DOC", out)
    monkeypatch.setattr(report_scale, "DOC", out)  # the plots go beside it
    monkeypatch.setattr(report_summary, "README", readme)
    report.main()
    assert out.read_text() == DOC.read_text(), "docs/benchmarks.md is stale: run python -m bench.report"
    assert readme.read_text() == report_summary.README.read_text(), "README.md's results are stale: python -m bench.report"


def test_the_doc_is_arranged_by_the_users_questions():
    headings = [ln[3:] for ln in DOC.read_text().splitlines() if ln.startswith("## ")]
    assert headings == [q.heading for q in report.QUESTIONS]
    assert headings == ["How good are the heads?", "How do they compare with speculators?",
                        "Where does speculation pay in serving, on GPU and on CPU?", "What does the data path cost?",
                        "How does training scale?", "What survives faults?"]
    text = DOC.read_text()
    for line in report.contents():  # the table of contents, before the first question
        assert text.index(line) < text.index("## How good are the heads?")
    sections = [ln for ln in text.splitlines() if ln.startswith("### ")]
    assert not [s for s in sections if "issue" in s.lower()], "section headings say what is measured, not the issue"


def test_anchor_is_githubs_fragment():
    assert anchor("## Where does speculation pay in serving, on GPU and on CPU?") == \
        "where-does-speculation-pay-in-serving-on-gpu-and-on-cpu"
    assert anchor("### peagle's trainer against speculators' at equal data and GPU-seconds") == \
        "peagles-trainer-against-speculators-at-equal-data-and-gpu-seconds"
    assert anchor("### Drafting cost vs K: one parallel forward against K sequential ones") == \
        "drafting-cost-vs-k-one-parallel-forward-against-k-sequential-ones"
