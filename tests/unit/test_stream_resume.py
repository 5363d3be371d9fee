"""pipelines.serve.resume: a stream cut mid-answer continues on another replica as one stream (same id, the text
so far continued, max_tokens what is left, usage of the whole answer)."""

import json

import pytest

from pipelines.serve.resume import StreamResume

pytestmark = pytest.mark.unit


def _chunk(text, *, id="chatcmpl-1", created=100, tokens=None, prompt=7, role=False, finish=None, chat=True):
    delta = {"role": "assistant", "content": ""} if role else {"content": text}
    choice = ({"index": 0, "delta": delta} if chat else {"index": 0, "text": text}) | {"finish_reason": finish}
    event = {"id": id, "created": created, "model": "m", "choices": [choice]}
    if tokens is not None:
        event["usage"] = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    return f"data: {json.dumps(event)}\n\n"


def _events(packet: str) -> list[dict]:
    return [json.loads(line[6:]) for line in packet.split("\n") if line.startswith("data: {")]


def test_a_chat_stream_continues_from_the_text_sent_with_what_is_left_of_max_tokens():
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "stream": True, "max_tokens": 10}
    r = StreamResume(body, chat=True)
    assert r.resumable
    up = r.upstream_body()
    assert up["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "stream_options" not in body  # the client's request is not changed
    sent = [r.observe(_chunk("", role=True, tokens=0)), r.observe(_chunk("one two", tokens=2)),
            r.observe(_chunk(" three", tokens=5))]  # a speculative chunk: 3 tokens at once
    assert all("usage" not in e for p in sent for e in _events(p))  # the client did not ask for usage
    rest = r.continuation()
    assert rest["max_tokens"] == 5 and rest["continue_final_message"] and not rest["add_generation_prompt"]
    assert rest["messages"][-1] == {"role": "assistant", "content": "one two three"}
    assert rest["messages"][:-1] == body["messages"]
    # the next leg: new id and prompt length, its role chunk dropped, ids rewritten, usage still stripped
    assert r.observe(_chunk("", role=True, id="chatcmpl-2", created=200, tokens=0, prompt=12)) == ""
    (e,) = _events(r.observe(_chunk(" four", id="chatcmpl-2", created=200, tokens=1, prompt=12, finish="stop")))
    assert (e["id"], e["created"], e["choices"][0]["delta"]["content"]) == ("chatcmpl-1", 100, " four")
    assert "usage" not in e
    usage_chunk = 'data: {"id": "chatcmpl-2", "created": 200, "choices": [], "usage": {"prompt_tokens": 12, ' \
                  '"completion_tokens": 1, "total_tokens": 13}}\n\ndata: [DONE]\n\n'
    assert r.observe(usage_chunk) == "data: [DONE]\n\n"  # the usage chunk the client did not ask for is dropped
    assert r.text == "one two three four"


def test_usage_the_client_asked_for_counts_the_whole_answer():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 10,
            "stream_options": {"include_usage": True}}
    r = StreamResume(body, chat=True)
    r.observe(_chunk("a b", tokens=2))
    r.continuation()
    r.observe(_chunk(" c", id="x2", tokens=1, prompt=9))
    (e,) = _events(r.observe('data: {"id": "x2", "created": 5, "choices": [], "usage": {"prompt_tokens": 9, '
                             '"completion_tokens": 1, "total_tokens": 10, "prompt_tokens_details": null}}\n\n'))
    assert e["usage"]["prompt_tokens"] == 7 and e["usage"]["completion_tokens"] == 3 and e["usage"]["total_tokens"] == 10
    assert e["id"] == "chatcmpl-1"


def test_a_completion_continues_its_prompt_and_an_answer_at_max_tokens_ends():
    body = {"model": "m", "prompt": "def f():", "stream": True, "max_tokens": 4, "echo": True}
    r = StreamResume(body, chat=False)
    r.observe(_chunk("\n    return", tokens=2, chat=False))
    rest = r.continuation()
    assert rest["prompt"] == "def f():\n    return" and rest["max_tokens"] == 2 and rest["echo"] is False
    r.observe(_chunk(" 1", tokens=2, chat=False))
    assert r.continuation() is None  # all 4 tokens were sent: nothing left, the stream just ends


def test_an_answer_whose_finish_reason_was_sent_is_not_continued():
    r = StreamResume({"model": "m", "messages": [], "stream": True, "max_tokens": 50}, chat=True)
    r.observe(_chunk("Blue.", tokens=2, finish="stop"))
    assert r.continuation() is None  # the replica died before [DONE]: the answer was whole already


def test_a_client_continuing_its_own_assistant_message_keeps_one():
    body = {"model": "m", "stream": True, "continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]}
    r = StreamResume(body, chat=True)
    r.observe(_chunk(" forty", tokens=1))
    rest = r.continuation()
    assert rest["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is forty"}]
    assert "max_tokens" not in rest


@pytest.mark.parametrize(("body", "chat"), [
    ({"model": "m", "messages": [], "stream": True, "n": 2}, True),
    ({"model": "m", "messages": [], "stream": True, "tools": [{"type": "function"}]}, True),
    ({"model": "m", "prompt": [1, 2, 3], "stream": True}, False),
    ({"model": "m", "messages": [], "stream": False}, True),
])
def test_what_is_not_resumed(body, chat):
    assert not StreamResume(body, chat=chat).resumable


def test_a_packet_that_does_not_parse_passes_unchanged_and_stops_resuming():
    r = StreamResume({"model": "m", "messages": [], "stream": True}, chat=True)
    assert r.observe("data: {not json\n\n") == "data: {not json\n\n"
    assert not r.resumable
    assert r.observe(_chunk("x", tokens=1)) == _chunk("x", tokens=1)  # passed through untouched from then on
