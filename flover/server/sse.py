"""Server-sent events of a streamed OpenAI answer, framed from the daemon's events: a pure state
machine (no I/O), so the framing is tested alone and the HTTP handler only moves bytes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from flover.reasoning import answer_stream
from flover.server import openai_api as oa

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    """One event: `data: <JSON>` and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class StreamFramer:
    """Feed it each (choice index, daemon event or ApiError) as it comes; it returns the frames to
    send. `done` once every choice has its final (or an error ended the answer): the last frames
    then end with `data: [DONE]`. A choice's first chunk carries its role (chat); with tools a
    choice's text is held until its final, when its calls are known."""

    plan: oa.Plan
    model_name: str
    token_bytes: Callable[[int], bytes]
    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)  # choices whose final (or error) was framed
    done: bool = False

    def __post_init__(self) -> None:
        n = len(self.plan.choices)
        self.offsets = [0] * n  # characters of token text streamed per choice (completions' text_offset)
        self.held = [""] * n
        self.finals: list[dict | None] = [None] * n
        # thinking apart from the answer, token by token (flover/reasoning.py); with tools the
        # held text is split at the final instead
        split = self.plan.reasoning and self.plan.tool_syntax is None
        self.thinking = [answer_stream(self.plan.reasoning) for _ in range(n)] if split else None

    def frames(self, index: int | None, event: dict | oa.ApiError) -> list[str]:
        if isinstance(event, oa.ApiError):  # (index None: the front is stopping)
            self.finished.add(index)
            self.done = True
            return [sse(event.body()), DONE]
        if event["event"] == "token":
            return self._token(index, event)
        return self._final(index, event)

    def _token(self, index: int, event: dict) -> list[str]:
        plan, is_first = self.plan, index not in self.started
        if plan.tool_syntax is not None:
            self.held[index] += event.get("text") or ""
            return []
        text, logprobs = oa.stream_piece(
            plan, plan.choices[index], event, is_first, self.offsets[index], self.token_bytes
        )
        if logprobs and "tokens" in logprobs:  # offsets count token texts, as the answer's
            self.offsets[index] += sum(map(len, logprobs["tokens"]))
        if self.thinking is not None:
            return self._split(index, *self.thinking[index].feed(text or ""), logprobs)
        if not (text or logprobs or is_first):
            return []
        self.started.add(index)
        return [sse(oa.chunk(plan, self.model_name, index, text, None, is_first, logprobs))]

    def _split(self, index: int, thinking: str, answer: str, logprobs: dict | None = None) -> list[str]:
        """Chunks of thinking and of answer text (logprobs ride on the last; the role on the first)."""
        pieces = []
        if thinking:
            pieces.append(oa.reasoning_chunk(self.plan, self.model_name, index, thinking, index not in self.started))
            self.started.add(index)
        if answer or (logprobs and not pieces):
            pieces.append(oa.chunk(self.plan, self.model_name, index, answer, None, index not in self.started))
            self.started.add(index)
        if logprobs and pieces:
            pieces[-1]["choices"][0]["logprobs"] = logprobs
        return [sse(piece) for piece in pieces]

    def _final(self, index: int, event: dict) -> list[str]:
        """finish_reason in a chunk of its own, after every token (with tools: the held text, as
        content or calls); the usage chunk and [DONE] after the last choice's."""
        held = self._split(index, *self.thinking[index].finish()) if self.thinking is not None else []
        plan, is_first = self.plan, index not in self.started
        if plan.tool_syntax is not None:
            pieces = oa.tool_call_chunks(plan, self.model_name, index, self.held[index], event["finish_reason"])
        else:
            pieces = (
                [oa.chunk(plan, self.model_name, index, None, None, first=True)]
                if plan.kind == "chat" and is_first
                else []
            )
            pieces.append(
                oa.chunk(
                    plan, self.model_name, index, None, event["finish_reason"], first=is_first and plan.kind != "chat"
                )
            )
        self.started.add(index)
        self.finished.add(index)
        self.finals[index] = event
        frames = held + [sse(piece) for piece in pieces]
        if len(self.finished) == len(plan.choices):
            self.done = True
            if plan.include_usage:
                frames.append(sse(oa.usage_chunk(plan, self.model_name, self.finals)))
            frames.append(DONE)
        return frames
