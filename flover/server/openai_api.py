"""OpenAI's request and response shapes <-> flover's wire protocol (pure functions, no I/O).

A completion or chat request becomes one daemon request per choice (each prompt × `n`); the
engine fuses them into the same iterations like any other concurrent requests. What the
engine cannot honour yet is refused with a clear 400 (`Unsupported`), never ignored silently;
fields that do not change the result (`user`, ...) and unknown fields are accepted, the
unknown ones with a logged warning (as vLLM does).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from flover import tools as tool_calling
from flover.protocol import check_template_kwargs
from flover.reasoning import split_answer

# Daemon error code -> HTTP status. Client input is never a 500.
STATUS = {
    "invalid_request": 400,
    "prompt_too_long": 400,
    "bad_message": 400,
    "unknown_id": 400,
    "message_too_large": 413,
    "overloaded": 429,
    "shutting_down": 503,
    "connection_lost": 503,
    "engine_unresponsive": 503,
    "handshake_failed": 503,
}

# Fields of OpenAI's completion / chat APIs that need no action here.
NEUTRAL = {
    "model",
    "prompt",
    "messages",
    "stream",
    "stream_options",
    "user",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "top_logprobs",
    "echo",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "response_format",
    "best_of",
    "suffix",
    "logit_bias",
    "stop_token_ids",
    "parallel_tool_calls",
    "metadata",
    "store",
    "service_tier",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
}
MAX_CHOICES = 64  # prompts × n of one HTTP request
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit; the legacy API allowed 5)
MAX_JSON_DEPTH = 64  # nesting of a request body (OpenAI's own bodies need < 10; a JSON schema a few more)
INT64 = (-(1 << 63), (1 << 63) - 1)  # what msgpack, torch and the daemon take as an integer


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = (
            "server_error"
            if self.status >= 500
            else "rate_limit_error"
            if self.status == 429
            else "invalid_request_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def check_model(body: dict, model_name: str) -> None:
    """A body's `model`, if given, must be the served one (404 model_not_found)."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"model {model!r} does not exist; this server serves {model_name!r}", "model_not_found", "model"
        )


def unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", "unsupported", param)


@dataclass
class Choice:
    """One daemon request of an HTTP request: its wire fields and where it goes in the answer."""

    index: int
    source: dict  # exactly one of prompt / input_ids / messages
    params: dict
    counts_prompt: bool  # the first sample of its prompt: usage counts each prompt once, as OpenAI does
    echo: str | None = None  # `echo`: the prompt's text, put before the completion


@dataclass
class Plan:
    kind: str  # "completion" or "chat"
    choices: list[Choice]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # asked for logprobs, with this many alternatives per token
    tool_syntax: str | None = None  # tools were given: answers are parsed for calls in this syntax
    parallel_tool_calls: bool = True  # False: an answer's first call only
    echo: bool = False  # completions: the prompt (and, with logprobs, its logprobs) before the completion
    score_only: bool = False  # completions with echo and max_tokens 0: the prompt's logprobs, no completion
    # chats: the thinking ("think": an opening <think> block; "think_open": the same, opened by
    # the prompt; "harmony": gpt-oss's analysis channel) is reasoning_content (flover/reasoning.py); "": none
    reasoning: str = ""
    tools: list | None = None  # the request's tools, where answers are parsed for calls (their parameters' types)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def check_json_values(body) -> None:
    """Refuse what JSON can carry but nothing past this point can take, anywhere in the body, once,
    before any field is read: nesting deeper than MAX_JSON_DEPTH, strings that are not Unicode
    (a lone surrogate such as "\\ud800" is valid JSON, yet cannot be encoded as UTF-8), integers
    outside 64 bits and non-finite numbers (`1e999`, `NaN`). Iterative, so depth costs no stack."""
    stack = [(body, None, None, 0)]  # (value, parent entry, key or index, depth)
    while stack:
        entry = stack.pop()
        value, _, _, depth = entry
        why = None
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    why = "a string that is not valid Unicode (a lone surrogate)"
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not INT64[0] <= value <= INT64[1]:
                why = "an integer outside the signed 64-bit range"
        elif isinstance(value, float):
            if not math.isfinite(value):
                why = "a number that is not finite"
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                why = f"nesting deeper than {MAX_JSON_DEPTH} levels"
            else:
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for key, item in items:
                    if isinstance(key, str) and not key.isascii():
                        stack.append((key, entry, key, depth + 1))
                    stack.append((item, entry, key, depth + 1))
        if why is not None:
            where = _json_path(entry)
            top = where.split(".")[0].split("[")[0] or None  # the body's field it lies in
            raise ApiError(400, f"{where or 'the request body'}: {why}", param=top)


def _json_path(entry) -> str:
    keys = []
    while entry[1] is not None:
        keys.append(entry[2])
        entry = entry[1]
    path = ""
    for key in reversed(keys):
        path += f"[{key}]" if isinstance(key, int) else (f".{key}" if path else str(key))
    return path


def _number(body: dict, key: str, low: float | None = None, high: float | None = None):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{key}: expected a number, got {type(value).__name__}", param=key)
    if isinstance(value, int) and abs(value) > 2**53:  # no longer exactly a float
        raise ApiError(400, f"{key}: {value} is too large", param=key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"{key}: {value} is outside [{low}, {high}]", param=key)
    return value


def _integer(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ApiError(400, f"{key}: expected {expected}, got {value!r}", param=key)
    return value


def _boolean(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{key}: expected true or false, got {value!r}", param=key)
    return value


def sampling_params(body: dict, chat: bool) -> dict:  # noqa: C901 (a flat mapping of fields)
    """The daemon's `params` from OpenAI's fields (the daemon validates values further)."""
    if body.get("functions"):
        raise unsupported("functions", "the legacy functions API is not supported; send tools")
    if body.get("tools") and not chat:
        raise ApiError(400, "tools: a chat field (/v1/chat/completions)", param="tools")
    if _integer(body, "best_of", 1) not in (None, 1):
        raise unsupported("best_of", "only 1 is supported")
    if body.get("suffix") is not None:
        raise unsupported("suffix", "not supported")
    params: dict = {}
    bias = body.get("logit_bias")
    if bias:  # {"token id": bias}: JSON keys are strings
        if not isinstance(bias, dict) or not all(
            isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 11 for k in bias
        ):
            raise ApiError(400, "logit_bias: expected a map from token ids to numbers", param="logit_bias")
        params["logit_bias"] = [[int(k), v] for k, v in bias.items()]
    structured = structure_asked(body)
    if structured is not None:
        params["structured"] = structured
    k = logprobs_asked(body, chat)
    if k is not None:
        params.update(logprobs=True, top_logprobs=k)
        if body.get("echo"):
            params["prompt_logprobs"] = True
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, limit, 0)
    if max_tokens == 0:
        if chat or not body.get("echo"):
            raise ApiError(400, f"{limit}: 0 is only meaningful with echo (scoring a prompt)", param=limit)
        params["max_new_tokens"] = 1  # the one generated token is left out of the answer
    elif max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    else:  # OpenAI's defaults: 16 for completions, the rest of the context for a chat
        params["max_new_tokens"] = None if chat else 16
    temperature = _number(body, "temperature", 0.0, 2.0)
    params["temperature"] = 1.0 if temperature is None else float(temperature)  # OpenAI's default is 1
    for key in ("top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        value = _number(body, key)
        if value is not None:
            params[key] = float(value)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise ApiError(400, f"top_k: expected an integer, got {top_k!r}", param="top_k")
        params["top_k"] = max(top_k, 0)  # -1 (vLLM) and 0 both mean off
    for key in ("seed", "stop", "ignore_eos", "stop_token_ids"):
        if body.get(key) is not None:
            params[key] = body[key]
    return params


GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # vLLM's fields -> Structured kinds


def structure_asked(body: dict) -> dict | None:
    """The daemon's `structured` map from OpenAI's `response_format` or vLLM's guided_* fields
    (at most one of them), or None. The daemon checks the shape and compiles it (a 400 naming
    the problem when it cannot)."""
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")):
        raise ApiError(
            400,
            'response_format: expected {"type": "text" | "json_object" | "json_schema", ...}',
            param="response_format",
        )
    asked = [key for key in GUIDED if body.get(key) is not None]
    if fmt is not None and fmt["type"] != "text":
        asked.append("response_format")
    if len(asked) > 1:
        raise ApiError(400, f"{', '.join(asked)}: give one way of structuring the output", param=asked[0])
    if not asked:
        return None
    if asked[0] == "response_format":
        if fmt["type"] == "json_object":
            return {"kind": "json"}
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ApiError(
                400, 'response_format.json_schema: expected {"name": ..., "schema": {...}}', param="response_format"
            )
        return {"kind": "json_schema", "value": spec["schema"]}
    key = asked[0]
    value = body[key]
    if key == "guided_json" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    return {"kind": GUIDED[key], "value": value}


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """None when no logprobs are asked, else the number of alternatives per token. Chat:
    `logprobs: true` + `top_logprobs: k`; completions: `logprobs: k` (and `echo` for the prompt's)."""
    if chat:
        if body.get("echo") is not None:
            raise ApiError(400, "echo: a field of /v1/completions, not of chat", param="echo")
        wanted, top = _boolean(body, "logprobs"), _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top and not wanted:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        return (top or 0) if wanted else None
    if body.get("top_logprobs") is not None:
        raise ApiError(400, "top_logprobs: a chat field; /v1/completions takes logprobs: k", param="top_logprobs")
    _boolean(body, "echo")
    return _integer(body, "logprobs", 0, MAX_LOGPROBS)


def chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}]: expected an object with a role", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise unsupported("messages", f"messages[{i}]: only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content: expected a string or text parts", param="messages")
        message = {"role": m["role"], "content": content}
        calls = m.get("tool_calls")
        if calls:  # an assistant's earlier calls: {"id", "type": "function", "function": {"name", "arguments"}}
            if not isinstance(calls, list) or not all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments"), str)
                for c in calls
            ):
                raise ApiError(
                    400, f"messages[{i}].tool_calls: expected calls with function name and arguments", param="messages"
                )
            message["tool_calls"] = [
                {
                    "id": str(c.get("id", "")),
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                }
                for c in calls
            ]
        if m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise ApiError(400, f"messages[{i}].tool_call_id: expected a string", param="messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _prompts(prompt) -> list[dict]:
    """OpenAI's four prompt forms -> one source each."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [{"input_ids": prompt}]
        if all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt
        ):
            return [{"input_ids": p} for p in prompt]
    raise ApiError(
        400, "prompt: expected a string, a list of strings, a list of token ids or a list of such lists", param="prompt"
    )


def plan(
    body: dict, kind: str, model_name: str, warn, tool_syntax: str = tool_calling.HERMES, reasoning: str = ""
) -> Plan:
    """Check an OpenAI request body (a JSON object) and split it into daemon requests.
    `warn(text)` is told of fields this server does not know; `tool_syntax`: how this model
    writes tool calls (flover/tools.py, from its chat template); `reasoning`: chat answers' opening
    thinking block goes to reasoning_content (flover/reasoning.py)."""
    check_model(body, model_name)
    unknown = sorted(set(body) - NEUTRAL)
    if unknown:
        warn(f"ignoring unknown field(s) {', '.join(unknown)}")
    chat = kind == "chat"
    sources = [{"messages": chat_messages(body.get("messages"))}] if chat else _prompts(body.get("prompt"))
    params = sampling_params(body, chat)
    syntax = _tools_asked(body, sources, params, tool_syntax) if chat else None
    _template_kwargs_asked(body, sources, chat)
    n = _integer(body, "n", 1) or 1
    if len(sources) * n > MAX_CHOICES:
        raise ApiError(400, f"n × prompts = {len(sources) * n}: at most {MAX_CHOICES} per request", param="n")
    echo = bool(body.get("echo")) and not chat
    choices = []
    for source in sources:
        for sample in range(n):
            p = dict(params)
            if n > 1 and p.get("seed") is not None and isinstance(p["seed"], int):
                p["seed"] = p["seed"] + sample  # n different samples, each reproducible
            choices.append(
                Choice(len(choices), source, p, counts_prompt=sample == 0, echo=source.get("prompt") if echo else None)
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: expected a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options: expected an object", param="stream_options")
    return Plan(
        kind,
        choices,
        stream,
        bool(options.get("include_usage")) and stream,
        logprobs=params["top_logprobs"] if params.get("logprobs") else None,
        echo=echo,
        score_only=echo and body.get("max_tokens") == 0,
        tool_syntax=syntax,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        reasoning=_reasoning_style(body, reasoning) if chat else "",
        tools=body.get("tools") if syntax is not None else None,
    )


def _reasoning_style(body: dict, style: str) -> str:
    """A template whose generation prompt opens the thinking block closes it at once when the
    request turns thinking off (chat_template_kwargs enable_thinking false): the answer then
    starts outside it."""
    if style == "think_open" and (body.get("chat_template_kwargs") or {}).get("enable_thinking") is False:
        return "think"
    return style


def template_kwargs(body: dict) -> dict | None:
    """`chat_template_kwargs` (vLLM's; e.g. {"enable_thinking": false} for Qwen3), checked, or None."""
    kwargs = body.get("chat_template_kwargs")
    try:
        if kwargs is not None:
            check_template_kwargs(kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), param="chat_template_kwargs") from None
    return kwargs


def _template_kwargs_asked(body: dict, sources: list[dict], chat: bool) -> None:
    """A chat's template variables go beside its messages."""
    kwargs = template_kwargs(body)
    if kwargs is None:
        return
    if not chat:
        raise ApiError(400, "chat_template_kwargs: a chat field (/v1/chat/completions)", param="chat_template_kwargs")
    for source in sources:
        source["chat_template_kwargs"] = kwargs


def _tools_asked(body: dict, sources: list[dict], params: dict, syntax: str) -> str | None:
    """`tools`, `tool_choice`, `parallel_tool_calls`: the tools go to the daemon beside the
    messages (for the template); "required" or a named function become the request's structure.
    The syntax answers are parsed in, or None when no call can come (no tools, tool_choice none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice: needs tools", param="tool_choice")
        return None
    try:
        tool_calling.check_tools(tools)
        parallel = _boolean(body, "parallel_tool_calls")
        structure = tool_calling.required_structure(tools, choice, parallel is not False, syntax)
    except ValueError as e:
        raise ApiError(400, str(e), param="tools" if str(e).startswith("tools") else "tool_choice") from None
    if choice == "none":
        return None  # the model is not shown the tools and is not parsed for calls
    if structure is not None:
        if "structured" in params:
            raise ApiError(
                400,
                "tool_choice: a required call cannot be combined with response_format or guided_*",
                param="tool_choice",
            )
        params["structured"] = structure
    for source in sources:
        source["tools"] = tools
    return syntax


# -- answers ---------------------------------------------------------------------------------------
def usage(p: Plan, finals: list[dict]) -> dict:
    counted = [f["usage"] for c, f in zip(p.choices, finals) if c.counts_prompt]
    prompt = sum(u["prompt_tokens"] for u in counted)
    completion = 0 if p.score_only else sum(f["usage"]["completion_tokens"] for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.get("cached_tokens", 0) for u in counted)},
    }


def response(p: Plan, model: str, finals: list[dict], token_bytes) -> dict:
    """The non-streamed answer; finals[i] is choice i's final event. `token_bytes(id)`: what a
    token stands for (the tokenizer's), for logprobs."""
    if p.kind == "chat":
        choices = []
        for c, f in zip(p.choices, finals):
            message, finish = chat_message(p, f["text"], f["finish_reason"])
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": _logprobs(p, c, f, token_bytes),
                }
            )
        return {
            "id": f"chatcmpl-{p.id}",
            "object": "chat.completion",
            "created": p.created,
            "model": model,
            "choices": choices,
            "usage": usage(p, finals),
        }
    choices = [
        {
            "index": c.index,
            "text": (c.echo or "") + ("" if p.score_only else f["text"]),
            "finish_reason": f["finish_reason"],
            "logprobs": _logprobs(p, c, f, token_bytes),
        }
        for c, f in zip(p.choices, finals)
    ]
    return {
        "id": f"cmpl-{p.id}",
        "object": "text_completion",
        "created": p.created,
        "model": model,
        "choices": choices,
        "usage": usage(p, finals),
    }


def chat_message(p: Plan, text: str, finish_reason: str) -> tuple[dict, str]:
    """A chat answer's message and finish reason: with tools, the complete calls the text holds
    become `tool_calls` (finish reason "tool_calls"; the text before them stays the content; one
    call when parallel_tool_calls is false), also when max_tokens cut the answer after them."""
    thinking = {}
    if p.reasoning:  # (the calls are looked for in the answer after the thinking)
        reasoning, text = split_answer(text, p.reasoning)
        thinking = {"reasoning_content": reasoning}
    calls = []
    if p.tool_syntax is not None and finish_reason in ("stop", "length"):
        content, calls = tool_calling.parse_calls(text, p.tool_syntax, p.tools)
        calls = calls if p.parallel_tool_calls else calls[:1]
    if not calls:
        return {"role": "assistant", "content": text, **thinking}, finish_reason
    message = {"role": "assistant", "content": content or None, **thinking, "tool_calls": [c.openai() for c in calls]}
    return message, "tool_calls"


def tool_call_chunks(p: Plan, model: str, index: int, text: str, finish_reason: str) -> list[dict]:
    """A streamed chat's answer held back because tools were given: its content (if any), its
    calls as `delta.tool_calls`, then the finish reason."""
    message, finish = chat_message(p, text, finish_reason)
    out = [chunk(p, model, index, message["content"], None, first=True)]
    if message.get("reasoning_content"):
        out.insert(0, reasoning_chunk(p, model, index, message["reasoning_content"], first=True))
        out[1]["choices"][0]["delta"].pop("role")
    if "tool_calls" in message:
        calls = chunk(p, model, index, None, None)
        calls["choices"][0]["delta"] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}
        out.append(calls)
    out.append(chunk(p, model, index, None, finish))
    return out


def reasoning_chunk(p: Plan, model: str, index: int, thinking: str, first: bool = False) -> dict:
    """A streamed chat chunk of thinking: `delta.reasoning_content` (the role with the first)."""
    piece = chunk(p, model, index, None, None, first)
    delta = piece["choices"][0]["delta"]
    delta.pop("content", None)
    delta["reasoning_content"] = thinking
    return piece


def chunk(
    p: Plan,
    model: str,
    index: int,
    text: str | None,
    finish_reason: str | None,
    first: bool = False,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk of choice `index` (`finish_reason` only in its last chunk)."""
    if p.kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return {
            "id": f"chatcmpl-{p.id}",
            "object": "chat.completion.chunk",
            "created": p.created,
            "model": model,
            "choices": [choice],
        }
    choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
    return {
        "id": f"cmpl-{p.id}",
        "object": "text_completion",
        "created": p.created,
        "model": model,
        "choices": [choice],
    }


def stream_piece(p: Plan, c: Choice, event: dict, first: bool, offset: int, token_bytes) -> tuple[str, dict | None]:
    """A token event of choice `c` -> (the chunk's text, its logprobs object or None). The first
    event of an echoed completion also carries the prompt (and its logprobs); `offset`: the
    characters of token text of this choice streamed before (for `text_offset`)."""
    text = "" if p.score_only else (event.get("text") or "")
    if first and c.echo is not None:
        text = c.echo + text
    return text, _logprobs(p, c, event, token_bytes, offset, prompt=first)


def _logprobs(p: Plan, c: Choice, f: dict, token_bytes, offset: int = 0, prompt: bool = True) -> dict | None:
    """The logprobs object of one choice from a final (or token) event's fields, in OpenAI's
    chat or legacy completions shape; with echo, the prompt's tokens come first."""
    if p.logprobs is None:
        return None
    ids, values, tops = [], [], []
    if p.echo and prompt:
        ids += c.source["input_ids"]
        values += f.get("prompt_logprobs", [None] * len(c.source["input_ids"]))
        tops += f.get("prompt_top_logprobs") or [None] * len(values)
    if not p.score_only:
        new = f.get("token_ids", [])
        ids += new
        values += f.get("logprobs", [])
        tops += f.get("top_logprobs") or [[]] * len(new)
    pieces = {t: token_bytes(t) for t in {*ids, *(t for top in tops if top for t, _ in top)}}
    text = lambda t: pieces[t].decode("utf-8", errors="replace")  # noqa: E731
    if p.kind == "chat":
        entry = lambda t, v: {"token": text(t), "logprob": v, "bytes": list(pieces[t])}  # noqa: E731
        return {
            "content": [
                {**entry(t, v), "top_logprobs": [entry(a, w) for a, w in top or []]}
                for t, v, top in zip(ids, values, tops)
            ],
            "refusal": None,
        }
    offsets, dicts = [], []
    for t, v, top in zip(ids, values, tops):
        offsets.append(offset)
        offset += len(text(t))
        if v is None:  # the first prompt token: nothing predicts it
            dicts.append(None)
            continue
        alternatives = {text(a): w for a, w in top or []}
        alternatives.setdefault(text(t), v)  # OpenAI: the chosen token is always among them
        dicts.append(alternatives)
    return {"tokens": [text(t) for t in ids], "token_logprobs": values, "top_logprobs": dicts, "text_offset": offsets}


def usage_chunk(p: Plan, model: str, finals: list[dict]) -> dict:
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    prefix = "chatcmpl" if p.kind == "chat" else "cmpl"
    return {
        "id": f"{prefix}-{p.id}",
        "object": obj,
        "created": p.created,
        "model": model,
        "choices": [],
        "usage": usage(p, finals),
    }
