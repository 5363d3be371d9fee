"""``data`` (and ``evaluation.sources``): prompt sources, their mixing and the train/eval split."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.recipe.base import KEY_NEUTRAL_WHEN_NONE, OnBadRow, Section
from pipelines.recipe.traffic import TrafficSourceConfig

SourceKind = Literal["sharegpt", "humaneval", "sharegpt_file", "openai_jsonl", "mtbench", "self_instruct", "traffic",
                     "python_functions"]
PACKAGED_KINDS = ("sharegpt", "humaneval", "mtbench")
FILE_KINDS = ("sharegpt_file", "openai_jsonl")


class SelfInstructConfig(Section):
    """Prompts written by the target itself (Magpie, arXiv 2406.08464): the aligned target sees only
    its chat template up to the opening of a user turn and completes it (``pipelines.data.selfinstruct``)."""

    num_prompts: int = Field(1000, ge=1, description="Completions requested from the target; at most this many "
                             "prompts are kept after the length filters and duplicate removal.")
    seed: int = Field(0, description="Sampling seed (per-request seeds derive from it: same seed, same prompts).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (> 0: greedy would write one "
                               "prompt N times; Magpie uses 1.0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(256, ge=1, description="Max new tokens per prompt; a prompt that has not reached the "
                            "end-of-turn token by then is dropped (counted 'unfinished').")
    min_chars: int = Field(16, ge=1, description="Drop prompts shorter than this (characters, after strip).")
    max_chars: int = Field(4096, ge=1, description="Drop prompts longer than this (characters, after strip).")
    dedup_threshold: float | None = Field(
        0.7, gt=0.0, le=0.98, description="Near-duplicate removal: a prompt whose estimated Jaccard similarity "
        "(datasketch MinHash over word 3-grams, MinHashLSH with 128 permutations, which needs <= 0.98) with an "
        "earlier kept prompt is >= this is dropped; None = exact-duplicate removal only.",
    )
    system_prompt: str | None = Field(
        None, description="Optional system turn rendered before the user turn (steers the topic, e.g. 'You are "
        "a Python coding assistant.'); kept in the conversations, so the answers see it too.",
    )

    turns: Annotated[int | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, ge=1, description="User turns per conversation: consecutive kept prompts are packed into conversations "
        "of this many user turns, each answered by the target after the turns before it (regenerate.max_turns must "
        "allow them), so a head sees long histories of the target's own answers; one conversation's topics are "
        "unrelated. None = 1.",
    )

    @model_validator(mode="after")
    def _lengths(self):
        if self.min_chars > self.max_chars:
            raise ValueError(f"self_instruct.min_chars={self.min_chars} > max_chars={self.max_chars}; "
                             "set min_chars <= max_chars")
        return self


class SourceConfig(Section):
    """One prompt source, normalized to {id, messages=[{role, content}], source}."""

    kind: SourceKind = Field(
        "sharegpt",
        description="sharegpt / humaneval / mtbench: the packaged files (ShareGPT V3 split, HumanEval, MT-Bench's "
        "80 questions); sharegpt_file: a user ShareGPT JSON or JSONL file ({conversations:[{from,value}]}); "
        "openai_jsonl: a user JSONL file of {messages:[{role,content}]}; self_instruct: prompts written by the "
        "target (settings in `self_instruct`; needs the regenerate stage's engine); traffic: the Serve traffic log "
        "(serving.traffic_log; settings in `traffic`); python_functions: completion prompts (signature and "
        "docstring of each public module-level function) from the Python files under `path`, default the "
        "interpreter's standard library.",
    )
    path: str | None = Field(
        None, description="File for sharegpt_file / openai_jsonl (~ and $VARS expanded); traffic: the log directory "
        "or a pyarrow.fs URI (None = every log under $PEAGLE_HOME/traffic); python_functions: a directory of .py "
        "files or one file (None = the standard library); unused otherwise."
    )
    num_samples: int | None = Field(
        None, ge=1, description="Conversations drawn from this source (deterministic, data.seed); None = all."
    )
    filter_regex: str | None = Field(
        None,
        description="Keep only conversations whose first user turn matches this Python regular expression "
        "(re.search; add (?i) for case-insensitive), e.g. to match the traffic a head will serve. Applied "
        "before num_samples.",
    )
    weight: Annotated[float | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, gt=0.0,
        description="Relative share of data.num_samples drawn from this source (e.g. 3 and 1: 75% / 25%; "
        "deterministic, data.seed). Set it on every source or on none; None everywhere = concatenate the sources "
        "and draw data.num_samples from the union. Applied after this source's filter_regex and num_samples.",
    )
    turns: Annotated[int | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, ge=1, le=2,
        description="mtbench only: 1 (default) = each question's first turn; 2 = also its second turn, asked "
        "after the target's own answer to the first (evaluation only: the engine answers turn 1 first).",
    )
    self_instruct: Annotated[SelfInstructConfig | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="self_instruct only: generation, filter and dedup settings (defaults when omitted)."
    )
    traffic: Annotated[TrafficSourceConfig | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="traffic only: time split, dedup and greedy-answer settings (defaults when omitted)."
    )

    @field_validator("filter_regex")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"filter_regex {v!r} is not a valid regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _path_matches_kind(self):
        if self.kind in FILE_KINDS and not self.path:
            raise ValueError(f"source kind {self.kind!r} needs `path`: set it to a local JSON/JSONL file")
        if self.kind not in FILE_KINDS and self.kind not in ("traffic", "python_functions") and self.path:
            what = "reads its packaged file" if self.kind in PACKAGED_KINDS else "is written by the target"
            raise ValueError(
                f"source kind {self.kind!r} {what}; drop `path` or use kind "
                f"{'sharegpt_file' if self.kind == 'sharegpt' else 'openai_jsonl'}"
            )
        if self.turns is not None and self.kind != "mtbench":
            raise ValueError(f"`turns` is an mtbench setting; drop it from the {self.kind!r} source")
        if self.self_instruct is not None and self.kind != "self_instruct":
            raise ValueError(f"`self_instruct` settings belong to kind self_instruct; drop them from the "
                             f"{self.kind!r} source or set kind: self_instruct")
        if self.kind == "self_instruct" and self.self_instruct is None:
            object.__setattr__(self, "self_instruct", SelfInstructConfig())  # no validate_assignment loop
        if self.traffic is not None and self.kind != "traffic":
            raise ValueError(f"`traffic` settings belong to kind traffic; drop them from the {self.kind!r} source "
                             "or set kind: traffic")
        if self.kind == "traffic" and self.traffic is None:
            object.__setattr__(self, "traffic", TrafficSourceConfig())
        return self

    def resolved_path(self) -> Path | None:
        return Path(os.path.expandvars(self.path)).expanduser() if self.path else None

    def eval_set_name(self) -> str:
        """Name of this source's prompt set when it is an evaluation source (rows carry it as ``eval_set``):
        the user file's stem, else the kind (``mtbench-2turn`` for MT-Bench with ``turns: 2``); a traffic
        log: ``traffic``, or ``traffic-<directory name>`` with a path."""
        if self.kind == "traffic":
            return f"traffic-{Path(self.path.rstrip('/')).name}" if self.path else "traffic"
        if self.path:
            return Path(self.path).stem
        return "mtbench-2turn" if self.kind == "mtbench" and self.turns == 2 else self.kind


class DataConfig(Section):
    """Prompt sources and split (stage: prompts / regenerate)."""

    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig(kind="sharegpt")], min_length=1, description="Prompt sources."
    )
    max_length_tokens: int = Field(2048, ge=16, description="Max conversation length in target tokens.")
    num_samples: int | None = Field(
        None, ge=1, description="Total conversations after merging the sources (deterministic); None = all."
    )
    eval_fraction: float = Field(
        0.05, ge=0.0, lt=1.0, description="Fraction of conversations held out for evaluation (0 = none)."
    )
    seed: int = Field(0, description="Seed for sampling and the train/eval split.")
    on_bad_row: OnBadRow = Field(
        "skip", description="Malformed rows: skip (count and log a warning with the row index) or fail (ValueError)."
    )

    @model_validator(mode="after")
    def _weights_all_or_none(self):
        weighted = [s.weight is not None for s in self.sources]
        if any(weighted) and not all(weighted):
            missing = [f"{i} ({s.kind})" for i, s in enumerate(self.sources) if s.weight is None]
            raise ValueError(f"data.sources weights are set on some sources only; set `weight` on source(s) "
                             f"{', '.join(missing)} too, or on none (plain concatenation)")
        return self
