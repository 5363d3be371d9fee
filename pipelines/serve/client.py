"""A client of the served endpoint: one chat request (the serve stage's smoke test) and the ``curl`` line
the summary prints."""

from __future__ import annotations

import json
import os
import time


def curl_line(url: str, model_id: str, api_key_env: str | None = None) -> str:
    """``curl`` of one chat request (the API key read from ``$api_key_env`` when set)."""
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "Write a Python function that "
                                                        "reverses a string."}], "max_tokens": 64, "temperature": 0})
    auth = f" -H \"Authorization: Bearer ${api_key_env}\"" if api_key_env else ""
    return f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def chat_once(url: str, model_id: str, *, api_key_env: str | None = None, timeout_s: float = 300.0) -> str:
    """One greedy chat request to the OpenAI endpoint (retried until ``timeout_s``); returns the answer.

    Raises:
        RuntimeError: no successful answer within ``timeout_s``.
    """
    import httpx

    headers = {"Authorization": f"Bearer {os.environ[api_key_env]}"} if api_key_env else {}
    body = {"model": model_id, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 16,
            "temperature": 0}
    deadline, last = time.time() + timeout_s, None
    while time.time() < deadline:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
            if r.status_code == 200:
                return r.json()["choices"][0]["message"]["content"]
            last = f"HTTP {r.status_code}: {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(3)
    raise RuntimeError(f"{url} did not answer a chat request within {timeout_s:.0f}s (last: {last})")
