"""Resuming a stream whose model replica died mid-answer: what the gateway (:mod:`pipelines.serve.gateway`) keeps of
the chunks it passed on, and the request that continues the answer on another replica.

The client keeps one stream: the chunks of the continuation carry the first leg's ``id`` and ``created``, the
continuation's opening role-only chunk is dropped, and a usage chunk counts the whole answer (prompt tokens of the
original request, completion tokens of both legs). How the continuation is asked for:

* chat (``/v1/chat/completions``): the messages plus an assistant message holding the text streamed so far, with
  vLLM's ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM's chat template API,
  ``vllm/entrypoints/openai/chat_completion/protocol.py``), so the model goes on from that text;
* completions (``/v1/completions``): the prompt (a string) followed by the text so far, ``echo`` off.

``max_tokens`` (or ``max_completion_tokens``) of the continuation is what is left of the original's: the gateway
asks the replica for ``stream_options.continuous_usage_stats`` (vLLM: ``usage`` on every chunk) and strips the
usage the client did not ask for, so the tokens already sent are counted exactly, speculative chunks of several
tokens included. The continuation re-tokenizes the text so far, so at the seam it may tokenize (and so continue)
differently from an uninterrupted stream; greedy answers otherwise continue as they would have.

Not resumable (the stream ends with :data:`pipelines.serve.ingress.STREAM_INTERRUPTED` as before): several choices
(``n`` > 1), tool calls, a completion prompt given as token ids, and any chunk the gateway cannot parse.
"""

from __future__ import annotations

import json
from typing import Any

DATA = "data: "


class StreamResume:
    """The state of one streamed answer as chunks pass through the gateway (one per request).

    Args:
        body: the client's request as a dict (``ChatCompletionRequest`` / ``CompletionRequest``
            ``model_dump(exclude_unset=True)``).
        chat: True for chat completions, False for completions.
    """

    def __init__(self, body: dict[str, Any], *, chat: bool) -> None:
        self.body, self.chat = body, chat
        options = body.get("stream_options") or {}
        self.client_usage = bool(options.get("include_usage"))
        self.client_continuous = bool(options.get("continuous_usage_stats"))
        self.text = ""  # the answer streamed to the client so far
        self.completion_tokens = 0  # of the legs before the current one
        self.leg_tokens = 0  # of the current leg (its last chunk's continuous usage)
        self.prompt_tokens: int | None = None
        self.id: str | None = None
        self.created: int | None = None
        self.legs = 1
        self.finished = False  # a choice carried its finish_reason: the answer is whole
        self.resumable = self.resumable_request(body, chat=chat)

    @staticmethod
    def resumable_request(body: dict[str, Any], *, chat: bool) -> bool:
        """Whether a stream of ``body`` can be continued on another replica (see the module docstring)."""
        if not body.get("stream") or (body.get("n") or 1) != 1 or body.get("tools"):
            return False
        return chat or isinstance(body.get("prompt"), str)

    def upstream_body(self) -> dict[str, Any]:
        """The first leg's request: the client's, asking the replica for usage on every chunk."""
        return self.body | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    def observe(self, packet: str) -> str:
        """Take one packet of server-sent events (``data: {json}\\n\\n`` lines) on its way to the client; return
        what the client gets (ids of the first leg, usage only as asked, a continuation's role chunk dropped).

        A packet that does not parse makes the stream not resumable and passes unchanged.
        """
        if not self.resumable:
            return packet
        out = []
        for line in packet.split("\n"):
            if not line.startswith(DATA):
                continue  # the blank lines between events (rebuilt below)
            if line == DATA + "[DONE]":
                out.append(line)
                continue
            try:
                keep = self._event(json.loads(line[len(DATA):]))
            except (ValueError, TypeError, KeyError, AttributeError):
                self.resumable = False
                return packet
            if keep is not None:
                out.append(DATA + json.dumps(keep, separators=(",", ":")))
        return "".join(f"{line}\n\n" for line in out)

    def _event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in event:
            return event
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = self.prompt_tokens if self.prompt_tokens is not None else usage.get("prompt_tokens")
            self.leg_tokens = int(usage.get("completion_tokens") or 0)
        if self.id is None:
            self.id, self.created = event.get("id"), event.get("created")
        event["id"], event["created"] = self.id, self.created
        choices = event.get("choices") or []
        for choice in choices:
            self.finished = self.finished or bool(choice.get("finish_reason"))
            if self.chat:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls"):
                    raise ValueError("tool calls are not resumed")
                self.text += delta.get("content") or ""
            else:
                self.text += choice.get("text") or ""
        if not choices:  # the usage chunk at the end of a leg
            if not self.client_usage:
                return None
            return event | {"usage": (usage or {}) | self.total_usage()}
        if self.legs > 1 and self.chat and self._role_only(choices):
            return None
        if usage is not None:
            if self.client_continuous:
                event["usage"] = usage | self.total_usage()
            else:
                event.pop("usage")
        return event

    @staticmethod
    def _role_only(choices: list[dict[str, Any]]) -> bool:
        return all(not (c.get("delta") or {}).get("content") and not c.get("finish_reason") for c in choices)

    def total_usage(self) -> dict[str, int]:
        """Usage of the whole answer so far: the original prompt, the completion tokens of every leg."""
        done = self.completion_tokens + self.leg_tokens
        prompt = self.prompt_tokens or 0
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def continuation(self) -> dict[str, Any] | None:
        """The request of the next leg, or None when nothing is left to generate (the answer reached its
        ``max_tokens``, or its finish reason was already sent). Call only when :attr:`resumable`."""
        if self.finished:
            return None
        self.completion_tokens += self.leg_tokens
        self.leg_tokens = 0
        self.legs += 1
        body = self.upstream_body()
        for key in ("max_tokens", "max_completion_tokens"):
            if body.get(key) is not None:
                left = int(body[key]) - self.completion_tokens
                if left <= 0:
                    return None
                body[key] = left
        if self.chat:
            messages = list(body.get("messages") or [])
            if body.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
                last = messages[-1]
                messages[-1] = last | {"content": (last.get("content") or "") + self.text}
            else:
                messages.append({"role": "assistant", "content": self.text})
            return body | {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
        return body | {"prompt": body["prompt"] + self.text, "echo": False}
