"""The framing of a streamed answer (server/sse.py), alone: daemon events in, server-sent events out."""

from __future__ import annotations

import json

from flover.server import openai_api as oa
from flover.server.sse import DONE, StreamFramer


def framer(body: dict, kind: str = "chat", tool_syntax=None) -> StreamFramer:
    body = {"max_tokens": 4, **body}
    plan = oa.plan(body, kind, "m", lambda _: None, **({"tool_syntax": tool_syntax} if tool_syntax else {}))
    return StreamFramer(plan, "m", lambda t: f"<{t}>".encode())


def token(text: str) -> dict:
    return {"event": "token", "token_ids": [7], "text": text}


def final(reason: str = "stop", completion: int = 2) -> dict:
    return {
        "event": "final",
        "finish_reason": reason,
        "text": "",
        "token_ids": [7] * completion,
        "usage": {"prompt_tokens": 3, "completion_tokens": completion},
    }


def payloads(frames: list[str]) -> list:
    assert all(f.startswith("data: ") and f.endswith("\n\n") for f in frames)
    return [f if f == DONE else json.loads(f[len("data: ") :]) for f in frames]


def test_a_chat_of_two_choices_frames_role_first_finish_last_usage_then_done():
    f = framer(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    first = payloads(f.frames(0, token("Hel")))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert payloads(f.frames(0, token("lo")))[0]["choices"][0]["delta"] == {"content": "lo"}
    assert not f.done
    end0 = payloads(f.frames(0, final("length")))
    assert [c["choices"][0]["finish_reason"] for c in end0] == ["length"] and not f.done
    end1 = payloads(f.frames(1, final("stop", 1)))  # choice 1 had no token: its role comes first
    assert end1[0]["choices"][0]["delta"]["role"] == "assistant" and end1[1]["choices"][0]["finish_reason"] == "stop"
    assert end1[2]["usage"]["completion_tokens"] == 3 and end1[2]["choices"] == []
    assert end1[-1] == DONE and f.done and f.finished == {0, 1}


def test_an_error_ends_the_answer_with_its_body_and_done():
    f = framer({"prompt": "x", "stream": True}, kind="completion")
    f.frames(0, token("a"))
    frames = payloads(f.frames(0, oa.ApiError(503, "shutting down", "shutting_down")))
    assert frames[0]["error"]["code"] == "shutting_down" and frames[-1] == DONE and f.done


def test_with_tools_text_is_held_until_the_final_names_the_calls():
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    f = framer({"messages": [{"role": "user", "content": "hi"}], "stream": True, "tools": tools})
    call = '<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>'
    assert f.frames(0, token(call[:10])) == [] and f.frames(0, token(call[10:])) == []
    frames = payloads(f.frames(0, final("stop")))
    calls = [c["choices"][0]["delta"].get("tool_calls") for c in frames if c != DONE]
    assert any(c and c[0]["function"]["name"] == "get" for c in calls)
    assert frames[-2]["choices"][0]["finish_reason"] == "tool_calls" and frames[-1] == DONE
