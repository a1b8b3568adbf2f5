"""Reading prompt files: `.txt` (one prompt a line) or `.jsonl` (one request object a line).

Lines are split on "\n" alone (a "\r\n" ending is dropped; a lone "\r" is part of the line), the
same from a file and from standard input, so ids never depend on how the input was read. Each
line is decoded as UTF-8 on its own: a line that is not gets an error record, the rest runs.

JSONL fields: `id` (a non-empty string of at most 256 characters, or an integer; default: the
line number), exactly one of `prompt`
(text), `input_ids` (token ids) or `messages` (chat, rendered with the checkpoint's template;
with them `chat_template_kwargs`, more variables for the template, as vLLM's: e.g. Qwen3's
`{"enable_thinking": false}`), and any SamplingParams field (`max_new_tokens`, `temperature`,
`stop`, ...); with `flover run --embed` a line is an embedding input (`prompt` or `input_ids`) and
may carry `dimensions` and `truncate_prompt_tokens` instead. Blank lines are skipped. A line that
cannot be a request still yields a record carrying its error, so that the output says what was
wrong with it (and a resumed run does not retry it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from flover.config import MAX_REQUEST_ID_LENGTH, SAMPLING_KEYS
from flover.protocol import check_template_kwargs

PROMPT_KEYS = ("prompt", "input_ids", "messages")
EMBED_KEYS = ("dimensions", "truncate_prompt_tokens", "document")  # an embedding input's own options (document: a pair)


class PromptFileError(ValueError):
    """The file as a whole cannot be processed (reported before any work starts)."""


@dataclass
class PromptRecord:
    index: int  # 0-based position among the file's records
    line: int  # 1-based line number
    id: str
    prompt: str | list[int] | None = None
    messages: list | None = None
    template_kwargs: dict | None = None  # more variables for the chat template (with messages)
    sampling: dict = field(default_factory=dict)  # per-request SamplingParams overrides
    embed_options: dict = field(default_factory=dict)  # an embedding input's EMBED_KEYS
    error: str | None = None  # the line is malformed; `code` says how
    code: str | None = None


def detect_format(name: str, first_line: str | None = None) -> str:
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".txt"):
        return "txt"
    if first_line is not None and first_line.lstrip().startswith("{"):
        return "jsonl"
    return "txt"


def iter_records(lines: Iterable[bytes | str], fmt: str) -> Iterator[PromptRecord]:
    """`lines`: a binary file (iterating one splits on b"\n" only) or already split lines."""
    index = 0
    for number, raw in enumerate(lines, 1):
        if isinstance(raw, bytes):
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield PromptRecord(
                    index,
                    number,
                    str(number),
                    code="malformed_line",
                    error=f"line {number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                )
                index += 1
                continue
        else:
            text = raw.removesuffix("\n").removesuffix("\r")
        if not text.strip():
            continue
        record = (
            PromptRecord(index, number, str(number), prompt=text)
            if fmt == "txt"
            else _parse_json_line(index, number, text)
        )
        index += 1
        yield record


def _parse_json_line(index: int, number: int, text: str) -> PromptRecord:
    def bad(message: str, rid: str = str(number), code: str = "malformed_line") -> PromptRecord:
        return PromptRecord(index, number, rid, error=f"line {number}: {message}", code=code)

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return bad(f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return bad("a JSON object is expected")
    rid = obj.get("id", number)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return bad("`id` must be a string or an integer")
    rid = str(rid)
    if not 0 < len(rid) <= MAX_REQUEST_ID_LENGTH:
        return bad(
            f"`id` must be a non-empty string of at most {MAX_REQUEST_ID_LENGTH} characters or an integer",
            code="invalid_request",
        )
    present = [k for k in PROMPT_KEYS if k in obj]
    if len(present) != 1:
        return bad(
            f"exactly one of {', '.join(PROMPT_KEYS)} is required (found {present or 'none'})", rid, "invalid_request"
        )
    unknown = sorted(set(obj) - set(PROMPT_KEYS) - SAMPLING_KEYS - set(EMBED_KEYS) - {"id", "chat_template_kwargs"})
    if unknown:
        return bad(f"unknown field(s) {unknown}", rid, "invalid_request")
    key = present[0]
    value = obj[key]
    record = PromptRecord(
        index,
        number,
        rid,
        sampling={k: obj[k] for k in obj if k in SAMPLING_KEYS},
        embed_options={k: obj[k] for k in EMBED_KEYS if k in obj},
    )
    if key == "prompt":
        if not isinstance(value, str):
            return bad("`prompt` must be a string", rid, "invalid_request")
        record.prompt = value
    elif key == "input_ids":
        if not isinstance(value, list):
            return bad("`input_ids` must be a list of integers", rid, "invalid_request")
        record.prompt = value
    else:
        record.messages = value
    if "chat_template_kwargs" in obj:
        if key != "messages":
            return bad("`chat_template_kwargs` go with `messages`", rid, "invalid_request")
        try:
            check_template_kwargs(obj["chat_template_kwargs"])
        except ValueError as e:
            return bad(str(e), rid, "invalid_request")
        record.template_kwargs = obj["chat_template_kwargs"]
    return record


def check_unique_ids(records: Iterable[PromptRecord]) -> set[str]:
    """Raise PromptFileError naming duplicated ids; return the set of ids."""
    seen: dict[str, int] = {}
    dups: dict[str, list[int]] = {}
    for record in records:
        if record.id in seen:
            dups.setdefault(record.id, [seen[record.id]]).append(record.line)
        else:
            seen[record.id] = record.line
    if dups:
        shown = "; ".join(f"id {rid!r} on lines {', '.join(map(str, ls))}" for rid, ls in list(dups.items())[:5])
        more = f" (and {len(dups) - 5} more)" if len(dups) > 5 else ""
        raise PromptFileError(f"duplicate ids in the input: {shown}{more}; nothing was run")
    return set(seen)
