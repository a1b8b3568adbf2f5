"""The wire protocol (docs/protocol.md): msgpack maps over a ZeroMQ ROUTER socket, no pickle.

Requests from clients:
  {"op": "generate", "id": ID, "prompt": str | "input_ids": [int] | "messages": [...],
   "params": {SamplingParams fields}, "stream": bool}
  {"op": "cancel", "id": ID}
  {"op": "health", "id"?: ID}    {"op": "stats", "id"?: ID}
Events to clients: "token", "final", "error", "health", "stats" (see the event helpers below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack

from flover.config import SAMPLING_KEYS, SamplingParams

OPS = ("generate", "cancel", "health", "stats")
PROMPT_KEYS = ("prompt", "input_ids", "messages")
GENERATE_KEYS = frozenset({"op", "id", "params", "stream", *PROMPT_KEYS})
MAX_ID_LENGTH = 256

# Error codes a client can act on.
BAD_MESSAGE = "bad_message"  # not msgpack, or not a map
UNKNOWN_OP = "unknown_op"
INVALID_REQUEST = "invalid_request"  # a field is missing, unknown, of the wrong type or out of range
PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_new_tokens > max_seq_len
DUPLICATE_ID = "duplicate_id"  # this client already has a request with this id in flight
UNKNOWN_ID = "unknown_id"  # cancel of an id this client has not in flight
OVERLOADED = "overloaded"  # the waiting queue is full: retry later
SHUTTING_DOWN = "shutting_down"
INTERNAL = "internal_error"


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str, request_id: str | None = None):
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


def request_id_of(message: dict) -> str | None:
    rid = message.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return None
    rid = str(rid)
    return rid if 0 < len(rid) <= MAX_ID_LENGTH else None


@dataclass
class GenerateRequest:
    id: str
    prompt: str | list[int] | None
    messages: list | None
    params: SamplingParams
    stream: bool = False


def parse_generate(message: dict) -> GenerateRequest:
    """Validate a generate message; raises ProtocolError naming the first problem."""
    rid = request_id_of(message)
    if rid is None:
        raise ProtocolError(INVALID_REQUEST, f"`id` must be a non-empty string or integer "
                                             f"(at most {MAX_ID_LENGTH} characters)")
    bad = lambda why: ProtocolError(INVALID_REQUEST, why, rid)  # noqa: E731
    unknown = sorted(str(k) for k in set(message) - GENERATE_KEYS)
    if unknown:
        raise bad(f"unknown field(s) {unknown}")
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
    for key, v in raw.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise bad(f"params.{key} must be finite")
    try:
        params = SamplingParams(**raw)
    except (ValueError, TypeError) as e:
        raise bad(str(e)) from None
    return GenerateRequest(rid, prompt, messages, params, stream)


# -- events -------------------------------------------------------------------------------
def error_event(code: str, message: str, request_id: str | None = None) -> dict:
    return {"event": "error", "id": request_id, "code": code, "message": message}


def token_event(request_id: str, token_ids: list[int], text: str | None) -> dict:
    return {"event": "token", "id": request_id, "token_ids": token_ids, "text": text}


def final_event(request_id: str, out, streamed: bool) -> dict:
    t = out.timings
    event = {"event": "final", "id": request_id, "finish_reason": out.finish_reason, "usage": out.usage,
             "timings": {"queue_s": t["queue_time"], "ttft_s": t["ttft"], "tpot_s": t["tpot"], "e2e_s": t["e2e"]}}
    if not streamed:  # a stream already carried every token and all the text
        event["text"], event["token_ids"] = out.text, out.token_ids
    if out.logprobs is not None:
        event["logprobs"] = out.logprobs
    return event
