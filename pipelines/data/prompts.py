"""Prompt sources loaded through ``datasets`` and normalized to one conversation schema.

Schema of every row (:mod:`pipelines.data.rows`): ``id: str``, ``messages: list[{role: str, content: str}]``,
``source: str``; roles system (optional, first), then user / assistant alternating from user.

Sources (``pipelines.recipe.SourceConfig.kind``):
- ``sharegpt``: the packaged ShareGPT V3 file (``{"id", "conversations": [{"from", "value"}]}``;
  ``human``/``user`` -> user, ``gpt``/``chatgpt``/``bing``/``bard``/``assistant`` -> assistant).
- ``humaneval``: the packaged HumanEval problems; each ``prompt`` becomes one user turn, id = task_id.
- ``mtbench``: MT-Bench's 80 packaged questions; the first of each question's two turns becomes one
  user turn, id = ``mtbench/<question_id>`` (two-turn evaluation: ``pipelines.evaluate.prompts.load_eval_prompts``).
- ``sharegpt_file``: a user ShareGPT JSON array or JSONL file.
- ``openai_jsonl``: a user JSONL file of ``{"messages": [{"role", "content"}], "id"?}``.
- ``traffic``: the Serve traffic log (``pipelines.data.traffic_source``): served chat requests, deduplicated, split by
  time (the newest slice is the held-out set: ``load_conversations(..., heldout=True)``, which
  evaluation uses). Its rows carry the optional column ``keep_answers`` (:data:`KEEP_ANSWERS`): True
  when the last assistant turn is the target's own greedy served answer, which regeneration keeps.
- ``python_functions``: completion prompts (a function's signature and docstring) cut from a tree of Python files,
  by default the interpreter's standard library (:mod:`pipelines.data.code_prompts`).
- ``self_instruct``: prompts written by the target itself (``pipelines.data.selfinstruct``). They need the
  target's engine, so :func:`load_conversations` refuses them;
  :func:`pipelines.data.prompt_dataset.load_prompt_dataset` takes them from its ``write_prompts`` callable
  (the regenerate stage passes ``pipelines.data.selfinstruct.SelfInstructWriter``).

Every file is read as raw JSON lines with ``datasets.load_dataset("text", ...)`` (a JSON array is
first rewritten as JSONL once, under ``$PEAGLE_HOME/data``: :mod:`pipelines.data.jsonl`), so a row with odd
types cannot break Arrow's schema inference and every malformed row is reported with its index
(0-based position in the file: line number - 1 for JSONL, array position for JSON). Per
``on_bad_row``, malformed rows are skipped (counted, logged with a warning) or raise ``ValueError``.

ShareGPT rows (both ShareGPT kinds) that start with assistant turns (the V3 "split" variant cuts long
conversations into chunks, and a chunk may open on an answer) lose those leading assistant turns and
are kept; the number of rows trimmed so is logged. Exact-duplicate conversations of a source (same
messages) are dropped and counted; a repeated id of a different conversation gets a ``~<n>`` suffix
(ids must be unique downstream).

One source per call here (rows, files, per-source steps, the train/held-out split); all sources
mixed into the recipe's prompt dataset: :mod:`pipelines.data.prompt_dataset`.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines import assets, settings
from pipelines.data import rows
from pipelines.data.jsonl import as_jsonl
from pipelines.data.rows import normalize_batch

if TYPE_CHECKING:
    import datasets

    from pipelines.recipe import SourceConfig

log = logging.getLogger(__name__)

MAX_REPORTED_BAD_ROWS = 5
# datasets hashes module-level functions by name: the normalized cache is keyed on this code instead
_MODULE_HASH = hashlib.sha256(Path(__file__).read_bytes() + Path(rows.__file__).read_bytes()).hexdigest()[:16]


def source_file(source_cfg: SourceConfig) -> tuple[Path, str]:
    """(file, source label) of a source. Packaged kinds resolve inside their packages.

    Raises:
        ValueError: a user file that does not exist; a self_instruct source (it has no file).
    """
    if source_cfg.kind == "sharegpt":
        return assets.sharegpt_path(), "sharegpt"
    if source_cfg.kind == "humaneval":
        return assets.humaneval_path(), "humaneval"
    if source_cfg.kind == "mtbench":
        return assets.mtbench_path(), "mtbench"
    if source_cfg.kind == "self_instruct":
        raise ValueError(SELF_INSTRUCT_NEEDS_ENGINE)
    if source_cfg.kind == "python_functions":
        from pipelines.data.code_prompts import SOURCE_KIND, stdlib_root

        return source_cfg.resolved_path() or stdlib_root(), SOURCE_KIND
    if source_cfg.kind == "traffic":
        from pipelines.data.traffic_source import SOURCE_LABEL, source_uri

        return Path(source_uri(source_cfg)), SOURCE_LABEL
    path = source_cfg.resolved_path()
    if path is None or not path.is_file():
        raise ValueError(f"source {source_cfg.kind} path={source_cfg.path!r} is not a file; fix data.sources[].path")
    return path, f"{source_cfg.kind}:{path.name}"


SELF_INSTRUCT_NEEDS_ENGINE = (
    "a self_instruct source has no file: its prompts are written by the target, so they need an engine. Load "
    "the sources with pipelines.data.prompt_dataset.load_prompt_dataset(data, write_prompts="
    "pipelines.data.selfinstruct.SelfInstructWriter(target, "
    "regenerate, data)) (the regenerate stage does), or generate them with "
    "pipelines.data.selfinstruct.generate_prompts(engine, source.self_instruct)"
)


# ---------------------------------------------------------------------------------------------- datasets


def load_conversations(
    source_cfg: SourceConfig, on_bad_row: str = "skip", home: Path | None = None, seed: int = 0, *,
    heldout: bool = False,
) -> datasets.Dataset:
    """Load one source as a normalized ``datasets.Dataset`` (columns id, messages, source).

    Malformed rows are skipped or fail (``on_bad_row``), exact-duplicate conversations dropped, repeated
    ids made unique (all counted in the log). ``source_cfg.num_samples`` (if set) draws that many
    conversations deterministically (``seed``) after that. Datasets' Arrow cache lives under
    ``$PEAGLE_HOME/hf-datasets``. A ``traffic`` source is read by :func:`pipelines.data.traffic_source.load_traffic`
    (its own dedup and time split; ``heldout``: its newest slice when its split is ``auto``).

    Raises:
        ValueError: a missing file; a python_functions tree without a kept function; a self_instruct source
            (needs an engine:
            :func:`pipelines.data.prompt_dataset.load_prompt_dataset`);
            with ``on_bad_row="fail"`` the first malformed rows (with their indices); with ``"skip"`` only
            if no row is usable.
    """
    import datasets

    if on_bad_row not in ("skip", "fail"):
        raise ValueError(f"on_bad_row={on_bad_row!r}; use 'skip' or 'fail'")
    if source_cfg.kind == "traffic":
        from pipelines.data.traffic_source import SOURCE_LABEL, load_traffic

        return finish_source(load_traffic(source_cfg, heldout=heldout), source_cfg, SOURCE_LABEL, seed)
    path, label = source_file(source_cfg)
    if source_cfg.kind == "python_functions":
        from pipelines.data.code_prompts import function_prompts

        return finish_source(rows.rows_dataset(function_prompts(path)), source_cfg, label, seed)
    jsonl = as_jsonl(path, home, known_truncated=source_cfg.kind == "sharegpt")  # the packaged file: cut upstream
    cache_dir = str(settings.hf_datasets_dir(home))
    raw = datasets.load_dataset("text", data_files=str(jsonl), split="train", cache_dir=cache_dir)
    # datasets hashes module-level functions by name, so a code change would reuse a stale cache:
    # key the normalized cache on this module's source and the input file instead.
    st = jsonl.stat()
    fingerprint = hashlib.sha256(
        f"{_MODULE_HASH}|{label}|{jsonl.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    ).hexdigest()[:32]
    ds = raw.map(
        normalize_batch, batched=True, with_indices=True, fn_kwargs={"source": label},
        remove_columns=raw.column_names, desc=f"normalize {label}", new_fingerprint=fingerprint,
    )
    bad = ds.filter(lambda e: bool(e), input_columns="error")
    if len(bad):
        shown = bad.select(range(min(len(bad), MAX_REPORTED_BAD_ROWS)))["error"]
        counts = Counter(bad["reason"])
        summary = ", ".join(f"{reason}: {n}" for reason, n in counts.most_common())
        more = f"\n  ... and {len(bad) - len(shown)} more" if len(bad) > len(shown) else ""
        report = f"({summary})\n  " + "\n  ".join(shown) + more
        if on_bad_row == "fail":
            raise ValueError(
                f"{len(bad)} malformed row(s) in {path} (data.on_bad_row=fail; set it to skip to drop them):\n"
                f"  {report}"
            )
        # the packaged ShareGPT file's malformed rows are known (assets.sharegpt_path): counted, not alarming
        log.log(logging.INFO if source_cfg.kind == "sharegpt" else logging.WARNING,
                "skipped %d malformed row(s) of %d in %s:\n  %s", len(bad), len(ds), path, report)
    good = ds.filter(lambda e: not e, input_columns="error")
    if len(good) == 0:
        raise ValueError(f"no usable conversations in {path} ({len(bad)} malformed rows)")
    trimmed = [n for n in good["leading_dropped"] if n]
    if trimmed:
        log.info("kept %d conversation(s) of %s that started with assistant turns by dropping their %d leading "
                 "assistant turn(s)", len(trimmed), label, sum(trimmed))
    good = _drop_duplicates(good, label).remove_columns(["error", "reason", "leading_dropped", "key"])
    log.info("%s: %d rows, %d malformed, %d usable conversations", label, len(ds), len(bad), len(good))
    return finish_source(good, source_cfg, label, seed)


def _drop_duplicates(ds: datasets.Dataset, label: str) -> datasets.Dataset:
    """Rows of ``ds`` (with a ``key`` column: hash of the messages) minus exact-duplicate conversations
    (first kept), with repeated ids of different conversations suffixed ``~1``, ``~2``, ... ."""
    seen: set[str] = set()
    keep = []
    for i, key in enumerate(ds["key"]):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    if len(keep) < len(ds):
        log.info("dropped %d exact-duplicate conversation(s) of %s", len(ds) - len(keep), label)
        ds = flat(ds.select(keep))
    ids = ds["id"]
    counts: Counter = Counter()
    unique = []
    for rid in ids:
        unique.append(rid if counts[rid] == 0 else f"{rid}~{counts[rid]}")
        counts[rid] += 1
    if unique != ids:
        log.info("%d repeated id(s) of different conversations in %s made unique with a ~<n> suffix",
                 sum(a != b for a, b in zip(unique, ids)), label)
        ds = ds.map(lambda _, idx: {"id": unique[idx]}, with_indices=True, input_columns="id",
                    desc=f"unique ids {label}")
    return ds


def finish_source(ds: datasets.Dataset, source_cfg: SourceConfig, label: str, seed: int) -> datasets.Dataset:
    """The per-source steps after loading: ``filter_regex``, then ``num_samples`` drawn with ``seed``."""
    if source_cfg.filter_regex:
        ds = filter_first_user_turn(ds, source_cfg.filter_regex, label)
    if source_cfg.num_samples is not None:
        ds = sample(ds, source_cfg.num_samples, seed)
    return ds


def filter_first_user_turn(ds: datasets.Dataset, pattern: str, label: str = "source") -> datasets.Dataset:
    """Rows of ``ds`` whose first user turn matches ``pattern`` (``re.search``), in order.

    Raises:
        ValueError: no row matches (names the pattern and the source).
    """
    rx = re.compile(pattern)
    keep = [i for i, msgs in enumerate(ds["messages"])
            if rx.search(next((m["content"] for m in msgs if m["role"] == "user"), ""))]
    if not keep:
        raise ValueError(f"filter_regex {pattern!r} matches no conversation of {label} ({len(ds)} rows); "
                         "loosen it or drop it")
    log.info("filter_regex kept %d of %d conversations of %s", len(keep), len(ds), label)
    return ds.select(keep)


def sample(ds: datasets.Dataset, num_samples: int | None, seed: int) -> datasets.Dataset:
    """``num_samples`` rows drawn deterministically (same seed -> same rows, same order); all rows if
    None. Warns when fewer rows exist than requested."""
    if num_samples is None:
        return ds
    if num_samples > len(ds):
        log.warning("requested %d conversations but only %d are usable; using all of them", num_samples, len(ds))
        num_samples = len(ds)
    return flat(ds.shuffle(seed=seed).select(range(num_samples)))


def flat(ds: datasets.Dataset) -> datasets.Dataset:
    """``ds``'s rows in their selected order (after ``select``, ``shuffle``) as a table of their own, taken by Arrow.
    ``datasets``' ``flatten_indices`` in the default Python format converts every nested ``messages`` row to Python and
    back: 550 rows/s for the 168k self-instruct prompts of issue 42's recipe (5 min), against ~0.1 s for 20k rows in
    the Arrow format. The rows, features and order are the same."""
    return ds.with_format("arrow").flatten_indices().with_format(None)


def train_eval_split(ds: datasets.Dataset, eval_fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Deterministic (train, eval) split; eval holds round(eval_fraction * len) rows (at least one when
    eval_fraction > 0 and there are two or more rows)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction={eval_fraction}; use a value in [0, 1)")
    num_eval = round(eval_fraction * len(ds))
    if eval_fraction > 0 and len(ds) >= 2:
        num_eval = min(max(num_eval, 1), len(ds) - 1)
    if num_eval == 0:
        return ds, ds.select([])
    split = ds.train_test_split(test_size=num_eval, seed=seed, shuffle=True)
    return split["train"], split["test"]
