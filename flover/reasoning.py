"""A model's thinking apart from its answer: `<think>...</think>` at the start of a chat answer
(Qwen3, SmolLM3 and the other templates that mention it) becomes OpenAI-style
`reasoning_content`, the rest `content` (vLLM's reasoning parsers, llama.cpp's
`--reasoning-format`). Pure text functions: the HTTP front applies them to whole answers and,
token by token, to streamed ones."""

from __future__ import annotations

import re
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
# Gemma 4's thinking channel (llama.cpp's models/templates/google-gemma-4-31B-it.jinja): its
# answers open with "<|channel>thought\n...<channel|>" when thinking is on; the generation prompt
# writes it empty and closed when thinking is off. Special tokens that its answers are parsed by
# (decode keeps them, as llama.cpp's converter makes them always rendered).
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>thought", "<channel|>"
CHANNEL_TOKENS = (
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
)
TAGS = {"think": (OPEN, CLOSE), "think_open": (OPEN, CLOSE), "channel": (CHANNEL_OPEN, CHANNEL_CLOSE)}


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template knows a thinking block (then answers are split by default)."""
    return template_source is not None and OPEN in template_source and CLOSE in template_source


def speaks_channels(template_source: str | None) -> bool:
    """Whether a chat template writes Gemma 4's thinking channel."""
    return template_source is not None and CHANNEL_OPEN in template_source and CHANNEL_CLOSE in template_source


def visible_special_tokens(template_source: str | None) -> set[str]:
    """The special tokens a chat template's answers are parsed by, kept when answers are decoded."""
    if not speaks_channels(template_source):
        return set()
    return {t for t in CHANNEL_TOKENS if t in template_source}


def split_reasoning(text: str, opened: bool = False, style: str = "think") -> tuple[str | None, str]:
    """(the thinking, the answer) of a whole chat answer: the thinking is the text of a block
    that opens the answer (whitespace may come first), None without one; an unclosed block (the
    answer was cut) is all thinking. The answer loses the whitespace after the block. `opened`:
    the prompt opened the block (Qwen3.5's generation prompt ends in "<think>\n"), so the answer
    starts inside it. Defined as ReasoningStream over the whole text: a streamed answer's deltas
    add up to it by construction."""
    stream = ReasoningStream.inside() if opened else ReasoningStream.of(style)
    thinking, answer = stream.feed(text)
    more = stream.finish()
    return (thinking + more[0] if stream.thought else None), answer + more[1]


@dataclass
class ReasoningStream:
    """A streamed answer's split: feed each piece of text, get (thinking, answer) deltas. Text
    that could still be the start of a tag is held back until it is decided, so a tag split across
    tokens never reaches a client half in one field and half in the other."""

    state: str = "start"  # start -> thinking -> answer
    held: str = ""
    after_block: bool = False  # the whitespace right after the block is dropped
    thought: bool = False  # a block opened (split_reasoning's thinking is None without one)
    open: str = OPEN  # the block's tags
    close: str = CLOSE

    @classmethod
    def inside(cls) -> "ReasoningStream":
        """A stream whose answer starts inside the thinking block (the prompt opened it)."""
        return cls(state="thinking", thought=True)

    @classmethod
    def of(cls, style: str) -> "ReasoningStream":
        """A stream for a template's style (template_format) whose answers open their own block."""
        tags = TAGS.get(style, (OPEN, CLOSE))
        return cls(open=tags[0], close=tags[1])

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        thinking = answer = ""
        opening, closing = self.open, self.close
        if self.state == "start":
            stripped = self.held.lstrip()
            if opening.startswith(stripped) and stripped != opening:  # (whitespace, or part of the tag): undecided
                return "", ""
            if not stripped.startswith(opening):
                self.state, answer, self.held = "answer", self.held, ""
                return "", answer
            self.state, self.held, self.thought = "thinking", stripped[len(opening) :], True
        if self.state == "thinking":
            end = self.held.find(closing)
            if end < 0:
                keep = _partial_tag(self.held, closing)
                thinking, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return thinking, ""
            thinking, self.held = self.held[:end], self.held[end + len(closing) :]
            self.state, self.after_block = "answer", True
        if self.state == "answer":
            answer, self.held = self.held, ""
            if self.after_block:
                answer = answer.lstrip()
                self.after_block = not answer  # (only whitespace so far: keep dropping it)
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """What is still held when the answer ends (an undecided start: whitespace or a part of the
        tag, is answer text; a part of the closing tag inside a block is thinking)."""
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


# -- gpt-oss's harmony format ------------------------------------------------------------------
# An answer is a run of messages: [<|start|>assistant] <|channel|>NAME [to=RECIPIENT] [<|constrain|>TYPE]
# <|message|>BODY <|end|> | <|return|> | <|call|>. Its special tokens stay in the text of a model
# whose chat template speaks it (models/tokenizer.py), so that the channels can be told apart.
MESSAGE = "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def speaks_harmony(template_source: str | None) -> bool:
    """Whether a chat template writes gpt-oss's harmony messages (its thinking and its tool calls)."""
    return template_source is not None and "<|channel|>" in template_source and MESSAGE in template_source


def template_format(template_source: str | None) -> str:
    """How a chat template's model writes its thinking: "harmony" (gpt-oss's channels), "channel"
    (Gemma 4's thinking channel), "think" (a <think> block), "think_open" (a block its generation
    prompt opens: the answer starts inside it, unless the request turns thinking off), or "" (it
    does not)."""
    if speaks_harmony(template_source):
        return "harmony"
    if speaks_channels(template_source):
        return "channel"
    if not template_thinks(template_source):
        return ""
    return "think_open" if opens_thinking(template_source) else "think"


def opens_thinking(template_source: str) -> bool:
    """Whether the template's generation prompt writes an opening <think> tag that it does not
    close (Qwen3.5: '<think>\n'; Qwen3 writes an empty, closed block only to turn thinking off)."""
    at = template_source.rfind("add_generation_prompt")
    tail = template_source[at:] if at >= 0 else ""
    return re.search(r"""['"]<think>(\\n|\n|\s)*['"]""", tail) is not None


@dataclass
class HarmonyStream:
    """A harmony answer streamed: the analysis channel's bodies are thinking, the final channel's
    (and a commentary to no one) the answer; a message to a tool (`to=functions.NAME`) stays in
    the answer as written, markers and all, for tools.parse_calls. Text outside any message is
    answer. Markers split across pieces are held back until decided."""

    state: str = "header"  # header (until <|message|>) -> body (until an end marker) -> header ...
    held: str = ""
    channel: str = ""
    tool: bool = False
    thought: bool = False  # an analysis message began (split_harmony's thinking is None without one)

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        out = ["", ""]
        while self._step(out):
            pass
        return out[0], out[1]

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "body" and not self.tool and self.channel == "analysis":
            return held, ""
        return "", held  # (a header cut off, or a body: as written)

    def _step(self, out: list[str]) -> bool:
        """One move of the state machine over the held text; False: wait for more."""
        if self.state == "header":
            if not self.held.startswith("<|"):  # text outside a message, up to where a marker may begin
                at = self.held.find("<|")
                at = len(self.held) - (1 if self.held.endswith("<") else 0) if at < 0 else at
                out[1], self.held = out[1] + self.held[:at], self.held[at:]
                return at > 0 and bool(self.held)
            at = self.held.find(MESSAGE)
            if at < 0:
                return False
            header, self.held = self.held[:at], self.held[at + len(MESSAGE) :]
            channel = _CHANNEL.search(header)
            self.channel = channel.group(1) if channel else ""
            self.tool = _RECIPIENT.search(header) is not None and self.channel != "analysis"
            self.thought |= self.channel == "analysis"
            if self.tool:
                out[1] += header + MESSAGE
            self.state = "body"
            return True
        ends = [(self.held.find(end), end) for end in MESSAGE_ENDS if end in self.held]
        if not ends:
            keep = max(_partial_tag(self.held, end) for end in MESSAGE_ENDS)
            self._route(self.held[: len(self.held) - keep], out)
            self.held = self.held[len(self.held) - keep :]
            return False
        at, end = min(ends)
        self._route(self.held[:at], out)
        out[1] += end if self.tool else ""
        self.held, self.state = self.held[at + len(end) :], "header"
        return True

    def _route(self, piece: str, out: list[str]) -> None:
        out[0 if self.channel == "analysis" and not self.tool else 1] += piece


def split_harmony(text: str) -> tuple[str | None, str]:
    """(the thinking, the answer) of a whole harmony answer, as HarmonyStream splits it."""
    stream = HarmonyStream()
    thinking, answer = stream.feed(text)
    more = stream.finish()
    return (thinking + more[0] if stream.thought else None), answer + more[1]


def split_answer(text: str, style: str) -> tuple[str | None, str]:
    """split_reasoning or split_harmony, by the template's style (template_format)."""
    if style == "harmony":
        return split_harmony(text)
    return split_reasoning(text, opened=style == "think_open", style=style)


def answer_stream(style: str):
    """A streamed answer's splitter, by the template's style."""
    if style == "harmony":
        return HarmonyStream()
    return ReasoningStream.inside() if style == "think_open" else ReasoningStream.of(style)
