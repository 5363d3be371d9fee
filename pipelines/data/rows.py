"""The conversation row every prompt source is normalized to, and its checks.

Schema of every row: ``id: str``, ``messages: list[{role: str, content: str}]``, ``source: str``.
Roles are ``system`` (optional, first only), then ``user`` / ``assistant`` alternating, starting with
``user``. A conversation may end on a user turn (a prompt the target answers when regenerating).
Raw rows of each source kind (ShareGPT, OpenAI JSONL, HumanEval, MT-Bench) are described in
:mod:`pipelines.data.prompts`; the traffic log's rows go through :func:`normalize_row` too
(:mod:`pipelines.data.traffic_source`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

SHAREGPT_KINDS = ("sharegpt", "sharegpt_file")
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}
KEEP_ANSWERS = "keep_answers"  # optional bool column: the assistant turns are the target's own; regenerate keeps them


class BadRow(ValueError):
    """A malformed source row; the message names the row index and the problem, ``reason`` is a
    short category (e.g. "wrong role order") used in skip summaries."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------------------------- rows


def _check_messages(
    messages: Any, index: int, source: str, role_key: str, content_key: str, drop_leading_assistant: bool = False,
) -> tuple[list[dict], int]:
    """(normalized messages, number of leading assistant turns dropped).

    ``drop_leading_assistant``: assistant turns before the first user turn (after an optional system
    turn) are dropped instead of failing the row.
    """
    where = f"{source} row {index}"
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"{where}: no turns (expected a non-empty list of messages)", "no turns")
    out = []
    for j, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise BadRow(f"{where}: turn {j} is {type(turn).__name__}, expected an object", "turn not an object")
        role = turn.get(role_key)
        if role is None:
            raise BadRow(f"{where}: turn {j} has no {role_key!r}", "missing role")
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise BadRow(f"{where}: turn {j} has unknown role {role!r} (known: {sorted(ROLE_ALIASES)})", "unknown role")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise BadRow(f"{where}: turn {j} {content_key!r} is {type(content).__name__}, expected a string", "non-string content")
        if not content.strip():
            raise BadRow(f"{where}: turn {j} ({role}) is empty", "empty turn")
        out.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    num_dropped = 0
    if drop_leading_assistant:
        start = 1 if out[0]["role"] == "system" else 0
        while start + num_dropped < len(out) and out[start + num_dropped]["role"] == "assistant":
            num_dropped += 1
        if num_dropped and start + num_dropped == len(out):
            raise BadRow(f"{where}: only assistant turns (no user turn to answer)", "no user turn")
        out = out[:start] + out[start + num_dropped:]
    roles = [m["role"] for m in out]
    body = roles[1:] if roles[0] == "system" else roles
    if not body:
        raise BadRow(f"{where}: only a system turn", "no turns")
    for j, role in enumerate(body):
        want = "user" if j % 2 == 0 else "assistant"
        if role != want:
            pos = j + (len(roles) - len(body)) + num_dropped  # index in the row as given
            raise BadRow(
                f"{where}: wrong role order {_short(roles)}: turn {pos} is {role!r}, expected {want!r} "
                "(system optional first, then user/assistant alternating, starting with user)",
                "wrong role order",
            )
    return out, num_dropped


def _short(roles: list[str], n: int = 4) -> str:
    return "[" + ", ".join(roles[:n]) + (", ...]" if len(roles) > n else "]")


def normalize_row(row: Any, index: int, source: str) -> dict[str, Any]:
    """Normalize one raw row of ``source`` (a SourceConfig kind) to ``{id, messages, source}``.

    ``row``: the parsed JSON object, or a JSON string (one line of a file). ``index``: its 0-based
    position, used in ids and error messages. ShareGPT rows lose leading assistant turns (module doc).

    Raises:
        BadRow (a ValueError): the row is malformed (not JSON / not an object, missing or unknown
            roles, empty turns, non-string content, wrong role order); the message names the row index.
    """
    return normalize_counted(row, index, source)[0]


def normalize_counted(row: Any, index: int, source: str) -> tuple[dict[str, Any], int]:
    """:func:`normalize_row` plus the number of leading assistant turns it dropped."""
    kind = source.split(":", 1)[0]
    if isinstance(row, str):
        try:
            row = json.loads(row)
        except json.JSONDecodeError as e:
            raise BadRow(f"{source} row {index}: not valid JSON ({e.msg} at column {e.colno})", "not JSON") from None
    if not isinstance(row, dict):
        raise BadRow(f"{source} row {index}: expected a JSON object, got {type(row).__name__}", "not an object")

    num_dropped = 0
    if kind in SHAREGPT_KINDS:
        if "conversations" not in row:
            raise BadRow(f"{source} row {index}: no 'conversations' field (ShareGPT rows are "
                         "{id, conversations: [{from, value}]})", "missing conversations")
        messages, num_dropped = _check_messages(row["conversations"], index, source, "from", "value",
                                                drop_leading_assistant=True)
    elif kind == "openai_jsonl":
        if "messages" not in row:
            raise BadRow(f"{source} row {index}: no 'messages' field (expected {{messages: [{{role, content}}]}})", "missing messages")
        messages, _ = _check_messages(row["messages"], index, source, "role", "content")
    elif kind == "humaneval":
        prompt = row.get("prompt")
        messages, _ = _check_messages([{"role": "user", "content": prompt}], index, source, "role", "content")
        row = {"id": row.get("task_id")}
    elif kind == "mtbench":
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns:
            raise BadRow(f"{source} row {index}: no 'turns' list (MT-Bench rows are {{question_id, turns}})",
                         "missing turns")
        messages, _ = _check_messages([{"role": "user", "content": turns[0]}], index, source, "role", "content")
        qid = row.get("question_id")
        row = {"id": None if qid is None else f"mtbench/{qid}"}
    else:
        raise ValueError(f"unknown source kind {kind!r}")
    rid = row.get("id")
    rid = f"{source}-{index}" if rid is None or rid == "" else str(rid)
    return {"id": rid, "messages": messages, "source": source}, num_dropped


def normalize_batch(batch: dict[str, list], indices: list[int], source: str) -> dict[str, list]:
    """A ``datasets`` batch of raw lines (column ``text``) normalized: the row columns plus ``error``, ``reason``,
    ``leading_dropped`` and ``key`` (sha1 of the messages, for exact-duplicate detection); blank lines skipped."""
    out: dict[str, list] = {"id": [], "messages": [], "source": [], "error": [], "reason": [], "leading_dropped": [],
                            "key": []}
    for line, index in zip(batch["text"], indices):
        if not line.strip():  # blank lines of a JSONL file are not rows
            continue
        try:
            norm, num_dropped = normalize_counted(line, index, source)
            err, reason = "", ""
        except BadRow as e:
            norm, num_dropped = {"id": f"{source}-{index}", "messages": [], "source": source}, 0
            err, reason = str(e), e.reason
        for k in ("id", "messages", "source"):
            out[k].append(norm[k])
        out["error"].append(err)
        out["reason"].append(reason)
        out["leading_dropped"].append(num_dropped)
        out["key"].append(hashlib.sha1(json.dumps(norm["messages"], ensure_ascii=False).encode()).hexdigest())
    return out


def rows_dataset(rows: Sequence[dict]) -> datasets.Dataset:
    """Rows ``{id, messages: [{role, content}], source}`` as a Dataset with the normalized columns.

    Raises:
        ValueError: no rows.
    """
    import datasets

    if not rows:
        raise ValueError("no prompt rows to load (a self_instruct source kept none: loosen its filters or raise "
                         "num_prompts)")
    return datasets.Dataset.from_dict({
        "id": [str(r["id"]) for r in rows],
        "messages": [[{"role": m["role"], "content": m["content"]} for m in r["messages"]] for r in rows],
        "source": [str(r.get("source", "")) for r in rows],
    })
