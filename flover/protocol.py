"""The wire protocol (docs/protocol.md): msgpack maps over a ZeroMQ ROUTER socket, no pickle.

Requests from clients:
  {"op": "generate", "id": ID, "prompt": str | "input_ids": [int] | "messages": [...],
   "params": {SamplingParams fields}, "stream": bool}
  {"op": "embed", "id": ID, "input": str | [int], "dimensions"?: int, "truncate_prompt_tokens"?: int,
   "document"?: str}   (a reranker's pair: `input` the query; the final's embedding is its score)
  {"op": "cancel", "id": ID}
  {"op": "health", "id"?: ID}    {"op": "stats", "id"?: ID}
Events to clients: "token", "final", "error", "health", "stats" (see the event helpers below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack
import zmq

from flover.config import MAX_REQUEST_ID_LENGTH, SAMPLING_KEYS, SamplingParams, is_int
from flover.tools import check_tools

OPS = ("generate", "embed", "cancel", "health", "stats")
MAX_MESSAGE_BYTES = 1 << 20  # the server's default bound on one message (--max-message-bytes)
PROMPT_KEYS = ("prompt", "input_ids", "messages")
GENERATE_KEYS = frozenset({"op", "id", "params", "stream", "tools", "chat_template_kwargs", *PROMPT_KEYS})
EMBED_KEYS = frozenset({"op", "id", "input", "dimensions", "truncate_prompt_tokens", "document"})
MAX_ID_LENGTH = MAX_REQUEST_ID_LENGTH  # characters of a string id

# Error codes a client can act on.
BAD_MESSAGE = "bad_message"  # not msgpack, not a map, or not one frame
MESSAGE_TOO_LARGE = "message_too_large"  # the frames of one message add up to more than the cap
UNKNOWN_OP = "unknown_op"
INVALID_REQUEST = "invalid_request"  # a field is missing, unknown, of the wrong type or out of range
PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_new_tokens > max_seq_len
DUPLICATE_ID = "duplicate_id"  # this connection already has a request with this id in flight
UNKNOWN_ID = "unknown_id"  # cancel of an id this connection has not in flight
OVERLOADED = "overloaded"  # the waiting queue is full: retry later
SHUTTING_DOWN = "shutting_down"
ROUTING_ID_NOT_ALLOWED = "routing_id_not_allowed"  # the socket set ZMQ_ROUTING_ID: identities are the server's
SLOW_CLIENT = "slow_client"  # the client left too many events unread: its requests were cancelled
INTERNAL = "internal_error"  # a bug; only the request concerned failed
ENGINE_UNRESPONSIVE = "engine_unresponsive"  # a pipeline stage (or, seen by a client, the server) went silent
# Codes that are a property of the request itself: sending it again fails again. Anything else
# (overloaded, shutting_down, slow_client, internal_error, a lost connection) is worth a retry.
PERMANENT = frozenset({BAD_MESSAGE, MESSAGE_TOO_LARGE, UNKNOWN_OP, INVALID_REQUEST, PROMPT_TOO_LONG})


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str, request_id: str | int | None = None):
        super().__init__(message)
        self.code, self.request_id = code, request_id


def pack(event: dict) -> bytes:
    return msgpack.packb(event, use_bin_type=True)


def unpack(frame: bytes) -> dict:
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several exception types for garbage
        raise ProtocolError(BAD_MESSAGE, f"not a msgpack message ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(BAD_MESSAGE, "a message must be a msgpack map")
    return message


def peek_id(frame: bytes):
    """The `id` of a message that `unpack` refuses or that failed later, read leniently, or None."""
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return None
    return echo_id(message) if isinstance(message, dict) else None


def echo_id(message: dict):
    """The `id` to put on an error about this message: exactly as sent if it is a string or an
    integer (even an invalid one, so that the client can match the error), else None."""
    rid = message.get("id")
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def request_id_of(message: dict):
    """The message's id (a string or an integer, returned as sent), or None if it is not a valid one."""
    rid = echo_id(message)
    if isinstance(rid, str) and not 0 < len(rid) <= MAX_ID_LENGTH:
        return None
    return rid


@dataclass
class GenerateRequest:
    id: str | int
    prompt: str | list[int] | None
    messages: list | None
    params: SamplingParams
    stream: bool = False
    tools: list | None = None  # with messages: OpenAI's tools, for the chat template (flover/tools.py)
    chat_template_kwargs: dict | None = None  # with messages: more variables for the chat template


def _checked_fields(message: dict, known: frozenset) -> tuple:
    """A request message's id (raises if it is not a valid one) and its fields all `known`; (the id,
    a ProtocolError maker for this request's invalid fields)."""
    rid = request_id_of(message)
    if rid is None:
        raise ProtocolError(
            INVALID_REQUEST,
            f"`id` must be a non-empty string of at most {MAX_ID_LENGTH} characters or an integer",
            echo_id(message),
        )
    bad = lambda why: ProtocolError(INVALID_REQUEST, why, rid)  # noqa: E731
    unknown = sorted(str(k) for k in set(message) - known)
    if unknown:
        raise bad(f"unknown field(s) {unknown}")
    return rid, bad


def parse_generate(message: dict) -> GenerateRequest:
    """Check a generate message's shape; the sampling fields are checked by SamplingParams (the
    one place that knows their limits). Raises ProtocolError naming the first problem."""
    rid, bad = _checked_fields(message, GENERATE_KEYS)
    present = [k for k in PROMPT_KEYS if k in message]
    if len(present) != 1:
        raise bad(f"exactly one of {', '.join(PROMPT_KEYS)} is required")
    prompt, messages = None, None
    value = message[present[0]]
    if present[0] == "prompt":
        if not isinstance(value, str):
            raise bad("`prompt` must be a string")
        prompt = value
    elif present[0] == "input_ids":
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise bad("`input_ids` must be a list of integers")
        prompt = value
    else:
        messages = value
    stream = message.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("`stream` must be true or false")
    raw = message.get("params", {})
    if not isinstance(raw, dict):
        raise bad("`params` must be a map")
    unknown = sorted(str(k) for k in set(raw) - SAMPLING_KEYS)
    if unknown:
        raise bad(f"unknown sampling parameter(s) {unknown}")
    try:
        params = SamplingParams(**raw)
    except (ValueError, TypeError) as e:
        raise bad(str(e)) from None
    try:
        tools = beside_messages(message, "tools", messages is not None, check_tools)
        template_kwargs = beside_messages(message, "chat_template_kwargs", messages is not None, check_template_kwargs)
    except ValueError as e:
        raise bad(str(e)) from None
    return GenerateRequest(rid, prompt, messages, params, stream, tools, template_kwargs)


@dataclass
class EmbedRequest:
    id: str | int
    input: str | list[int]
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    document: str | None = None  # a reranker's pair: `input` is its query


def parse_embed(message: dict) -> EmbedRequest:
    """Check an embed message's shape (one input; the engine checks the numbers against the model)."""
    rid, bad = _checked_fields(message, EMBED_KEYS)
    value = message.get("input")
    if not isinstance(value, str) and not (isinstance(value, list) and all(map(is_int, value))):
        raise bad("`input` must be a string or a list of integers (token ids)")
    numbers = {}
    for key in ("dimensions", "truncate_prompt_tokens"):
        number = message.get(key)
        if number is not None and (not is_int(number) or number < 1):
            raise bad(f"`{key}` must be a positive integer")
        numbers[key] = number
    document = message.get("document")
    if document is not None and (not isinstance(document, str) or not isinstance(value, str)):
        raise bad("`document` and `input` of a pair must both be strings")
    return EmbedRequest(rid, value, **numbers, document=document)


def beside_messages(request: dict, key: str, has_messages: bool, check) -> object | None:
    """A field that only chat requests may carry (`tools`, `chat_template_kwargs`): its checked
    value, or None when absent or null; ValueError naming the problem."""
    value = request.get(key)
    if value is None:
        return None
    if not has_messages:
        raise ValueError(f"`{key}` go with `messages`")
    check(value)
    return value


# chat_template_kwargs: names the template reads from flover itself are not the client's to set
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "tools",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "raise_exception",
        "strftime_now",
    }
)
MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_NAME, MAX_TEMPLATE_TEXT = 16, 64, 4096


def check_template_kwargs(kwargs) -> None:
    """`chat_template_kwargs` (vLLM's): a map of at most 16 names (identifiers, not flover's own
    template variables) to booleans, numbers, short strings or null; ValueError naming the problem."""
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs: expected a map of at most {MAX_TEMPLATE_KWARGS} names")
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier() or len(name) > MAX_TEMPLATE_NAME:
            raise ValueError(f"chat_template_kwargs: {str(name)[:80]!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_NAMES or name.startswith("_"):
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the server")
        scalar = (
            value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))
        )
        if not scalar or (isinstance(value, str) and len(value) > MAX_TEMPLATE_TEXT):
            raise ValueError(
                f"chat_template_kwargs.{name}: expected a boolean, a number, null or a string of at "
                f"most {MAX_TEMPLATE_TEXT} characters"
            )


# -- both ends ----------------------------------------------------------------------------
def tcp_keepalive(sock: zmq.Socket) -> None:
    """Find peers whose host vanished (no FIN/RST) in ~8 s. The kernel answers keepalive probes
    even when the program does not read, so a slow reader is never taken for a dead one.
    (ZeroMQ heartbeats are not used: a peer that stops reading cannot answer them, its healthy
    connection is dropped, and libzmq 4.3 can then abort on `_input_stopped`, libzmq#3937.)"""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 5)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)


# -- events -------------------------------------------------------------------------------
def error_event(code: str, message: str, request_id: str | int | None = None) -> dict:
    return {"event": "error", "id": request_id, "code": code, "message": message}


def token_event(request_id: str | int, out) -> dict:
    """The tokens `out` (a RequestOutput) adds, their text, and their logprobs when asked; the
    first token event also carries the prompt's logprobs when asked."""
    event = {"event": "token", "id": request_id, "token_ids": out.new_token_ids, "text": out.text_delta}
    new = len(out.new_token_ids)
    if out.logprobs is not None:
        event["logprobs"] = out.logprobs[len(out.logprobs) - new :]
    if out.top_logprobs is not None:
        event["top_logprobs"] = _pairs(out.top_logprobs[len(out.top_logprobs) - new :])
    if new and len(out.token_ids) == new:
        event.update(_prompt_logprobs(out))
    return event


def final_event(request_id: str | int, out, streamed: bool) -> dict:
    t = out.timings
    event = {
        "event": "final",
        "id": request_id,
        "finish_reason": out.finish_reason,
        "usage": out.usage,
        "timings": {"queue_s": t["queue_time"], "ttft_s": t["ttft"], "tpot_s": t["tpot"], "e2e_s": t["e2e"]},
    }
    if out.embedding is not None:  # an embed request's answer: its vector
        event["embedding"] = out.embedding
        return event
    if not streamed:  # a stream already carried every token, all the text and the logprobs
        event["text"], event["token_ids"] = out.text, out.token_ids
        if out.logprobs is not None:
            event["logprobs"] = out.logprobs
        if out.top_logprobs is not None:
            event["top_logprobs"] = _pairs(out.top_logprobs)
        event.update(_prompt_logprobs(out))
    return event


def _pairs(tops: list) -> list:
    """[(id, logprob)] per position -> [[id, logprob]] (None stays None): msgpack has no tuples."""
    return [None if top is None else [[t, v] for t, v in top] for top in tops]


def _prompt_logprobs(out) -> dict:
    if out.prompt_logprobs is None:
        return {}
    fields = {"prompt_logprobs": out.prompt_logprobs}
    if out.prompt_top_logprobs is not None:
        fields["prompt_top_logprobs"] = _pairs(out.prompt_top_logprobs)
    return fields
