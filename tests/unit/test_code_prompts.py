"""The python_functions prompt source: HumanEval-form prompts cut from Python files."""

from __future__ import annotations

import ast
import textwrap

import pytest

from pipelines.data.code_prompts import DOC_CHARS, function_prompts, stdlib_root
from pipelines.data.prompts import load_conversations
from pipelines.preflight import Machine
from pipelines.recipe import SourceConfig
from pipelines.stages.regenerate import RegenerateStage

pytestmark = pytest.mark.unit

DOC = "Return the sum of a and b, both integers, as an integer."
MODULE = textwrap.dedent(f'''
    import os

    @staticmethod
    def add(a: int, b: int = 2) -> int:
        """{DOC}"""
        total = a + b
        return total

    async def fetch(url, *, timeout=5.0):
        """Fetch url and return its body; raise TimeoutError after timeout seconds."""
        return await os.read(url)

    def _private(x):
        """A private helper that nobody should see in the prompts at all."""
        return x

    def short(x):
        """Too short."""
        return x

    def undocumented(x):
        return x

    def long_doc(x):
        """{'word ' * DOC_CHARS[1]}"""

    class C:
        def method(self):
            """A method of a class: only module-level functions are prompts."""
''')


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(MODULE)
    (tmp_path / "pkg" / "broken.py").write_text("def f(:\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(MODULE)
    return tmp_path


def test_prompts_are_signature_and_docstring_without_body(tree):
    rows = function_prompts(tree)
    assert [r["id"] for r in rows] == ["python_functions/pkg.mod.add", "python_functions/pkg.mod.fetch"]
    add = rows[0]["messages"]
    assert len(add) == 1 and add[0]["role"] == "user"
    text = add[0]["content"]
    assert text.startswith("def add(a: int, b: int=2) -> int:\n") and DOC in text
    assert "total" not in text and "staticmethod" not in text  # no body, no decorator
    tree_ = ast.parse(text)  # a valid stub, like a HumanEval prompt
    assert ast.get_docstring(tree_.body[0]) == DOC
    assert rows[1]["messages"][0]["content"].startswith("async def fetch(url, *, timeout=5.0):")


def test_one_file_and_errors(tree, tmp_path):
    assert len(function_prompts(tree / "pkg" / "mod.py")) == 2
    with pytest.raises(ValueError, match="does not exist"):
        function_prompts(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no public module-level function"):
        function_prompts(tree / "pkg" / "broken.py")


def test_standard_library_by_default(tmp_peagle_home):
    rows = function_prompts()
    assert 500 < len(rows) < 2000
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    assert not any(".test." in i or "idlelib" in i or "site-packages" in i for i in ids)
    # the source kind without a path names the tree: the same prompts, the standard library's skips applied
    assert function_prompts(stdlib_root()) == rows
    assert len(load_conversations(SourceConfig(kind="python_functions"), home=tmp_peagle_home)) == len(rows)


def test_source_loads_filters_and_samples(tree, tmp_peagle_home):
    src = SourceConfig(kind="python_functions", path=str(tree), filter_regex="async", num_samples=1)
    ds = load_conversations(src, home=tmp_peagle_home)
    assert ds["id"] == ["python_functions/pkg.mod.fetch"] and ds["source"] == ["python_functions"]


def test_missing_tree_is_a_machine_problem_before_compute(tmp_path):
    good = SourceConfig(kind="python_functions")
    bad = SourceConfig(kind="python_functions", path=str(tmp_path / "nowhere"))
    problems = RegenerateStage.source_problems("data.sources", [good, bad], Machine(num_gpus=0))
    assert [p.field for p in problems] == ["data.sources[1].path"] and "does not exist" in problems[0].message
