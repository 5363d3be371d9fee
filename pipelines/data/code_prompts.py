"""``python_functions`` prompt source: completion prompts cut from a tree of Python files.

Each public module-level function with a docstring becomes one prompt in HumanEval's form: the function's
signature and docstring, no body (``def f(x: int) -> str:\\n    \"\"\"...\"\"\"``), as one user turn. The target's
answers to them are code in the shape a code-completion workload asks for, so a head meant for such traffic
trains on it (the CPU demo: ``configs/smollm2-135m-cpu.yaml``, evaluated on HumanEval). Without a ``path`` the
tree is the running interpreter's standard library, which ships with every Python: real code, no download,
and none of HumanEval's hand-written problems.

Files and functions skipped: directories named like tests (``test``, ``tests``, ``test_*``) and, in the standard
library, packages that are demos, GUIs or vendored copies (:data:`STDLIB_SKIP`); files that do not parse
(counted in the log); names starting with ``_``; docstrings outside :data:`DOC_CHARS` characters (one-liners say
too little, long ones are manuals). Rows: ``id`` = ``python_functions/<module path>.<name>``, in file order then
line order (deterministic for a given tree).
"""

from __future__ import annotations

import ast
import logging
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_KIND = "python_functions"
DOC_CHARS = (40, 800)  # docstring length kept, characters (inclusive)
STDLIB_SKIP = frozenset({"idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
                         "dist-packages", "__phello__", "distutils", "pydoc_data"})


def stdlib_root() -> Path:
    """The running interpreter's standard library directory (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_test_dir(part: str) -> bool:
    return part in ("test", "tests") or part.startswith("test_")


def function_prompt(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``node``'s signature and docstring as source text, without decorators or body (HumanEval's prompt form).

    Raises:
        ValueError: ``node`` has no docstring.
    """
    if ast.get_docstring(node, clean=False) is None:
        raise ValueError(f"function {node.name!r} has no docstring")
    cls = type(node)
    stub = cls(name=node.name, args=node.args, body=[node.body[0]], decorator_list=[], returns=node.returns,
               type_params=getattr(node, "type_params", []))
    return ast.unparse(ast.fix_missing_locations(ast.Module(body=[stub], type_ignores=[]))) + "\n"


def function_prompts(root: Path | None = None) -> list[dict]:
    """Prompt rows ``{id, messages: [{role: user, content}], source}`` of every kept function under ``root``
    (a directory searched recursively, or one ``.py`` file; None = :func:`stdlib_root`, whose
    :data:`STDLIB_SKIP` packages are skipped however it is named). Module doc: what is kept.

    Raises:
        ValueError: ``root`` does not exist, or no function under it is kept.
    """
    root = stdlib_root() if root is None else Path(root)
    stdlib = root.resolve() == stdlib_root().resolve()  # its skips apply however the tree was named
    if not root.exists():
        raise ValueError(f"python_functions path {str(root)!r} does not exist; give a directory of .py files")
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    rows: list[dict] = []
    unparsable = 0
    for f in files:
        rel = f.relative_to(root.parent if root.is_file() else root)
        if any(_is_test_dir(p) or (stdlib and p in STDLIB_SKIP) for p in rel.parts[:-1]):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            unparsable += 1
            continue
        module = ".".join(rel.with_suffix("").parts)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if doc is None or not DOC_CHARS[0] <= len(doc) <= DOC_CHARS[1]:
                continue
            rows.append({"id": f"{SOURCE_KIND}/{module}.{node.name}", "source": SOURCE_KIND,
                         "messages": [{"role": "user", "content": function_prompt(node)}]})
    if unparsable:
        log.info("python_functions: %d file(s) under %s did not parse and were skipped", unparsable, root)
    if not rows:
        raise ValueError(f"python_functions: no public module-level function with a docstring of {DOC_CHARS[0]}-"
                         f"{DOC_CHARS[1]} characters under {root}")
    log.info("python_functions: %d prompts from %d files under %s", len(rows), len(files), root)
    return rows
