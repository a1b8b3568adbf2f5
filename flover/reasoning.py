"""A model's thinking apart from its answer: `<think>...</think>` at the start of a chat answer
(Qwen3, SmolLM3 and the other templates that mention it) becomes OpenAI-style
`reasoning_content`, the rest `content` (vLLM's reasoning parsers, llama.cpp's
`--reasoning-format`). Pure text functions: the HTTP front applies them to whole answers and,
token by token, to streamed ones."""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template knows a thinking block (then answers are split by default)."""
    return template_source is not None and OPEN in template_source and CLOSE in template_source


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(the thinking, the answer) of a whole chat answer: the thinking is the text of a block
    that opens the answer (whitespace may come first), None without one; an unclosed block (the
    answer was cut) is all thinking. The answer loses the whitespace after the block."""
    stripped = text.lstrip()
    if not stripped.startswith(OPEN):
        return None, text
    body = stripped[len(OPEN) :]
    end = body.find(CLOSE)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(CLOSE) :].lstrip()


@dataclass
class ReasoningStream:
    """split_reasoning over a streamed answer: feed each piece of text, get (thinking, answer)
    deltas. Text that could still be the start of a tag is held back until it is decided, so
    a tag split across tokens never reaches a client half in one field and half in the other."""

    state: str = "start"  # start -> thinking -> answer
    held: str = ""
    after_block: bool = False  # the whitespace right after the block is dropped, as split_reasoning does

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        thinking = answer = ""
        if self.state == "start":
            stripped = self.held.lstrip()
            if OPEN.startswith(stripped):  # (all whitespace, or a prefix of the tag): not decided yet
                return "", ""
            if not stripped.startswith(OPEN):
                self.state, answer, self.held = "answer", self.held, ""
                return "", answer
            self.state, self.held = "thinking", stripped[len(OPEN) :]
        if self.state == "thinking":
            end = self.held.find(CLOSE)
            if end < 0:
                keep = _partial_tag(self.held, CLOSE)
                thinking, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return thinking, ""
            thinking, self.held = self.held[:end], self.held[end + len(CLOSE) :]
            self.state, self.after_block = "answer", True
        if self.state == "answer":
            answer, self.held = self.held, ""
            if self.after_block:
                answer = answer.lstrip()
                self.after_block = not answer  # (only whitespace so far: keep dropping it)
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """What is still held when the answer ends (an undecided start is answer text)."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return "", held.lstrip() if self.after_block else held


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
