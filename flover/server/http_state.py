"""The HTTP front's state and plumbing: `Front` (the client to the daemon, the tokenizer, the worker
threads), the API-key guard, errors in OpenAI's shape, and request bodies read within bounds."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse

from flover.client import AsyncClient, FloverError
from flover.engine.intake import Intake
from flover.hardware import background_thread
from flover.models.model_config import ModelConfig
from flover.protocol import MAX_MESSAGE_BYTES
from flover.reasoning import template_format
from flover.server import openai_api as oa
from flover.structured.spec import GrammarLimits
from flover.tools import syntax_of

log = logging.getLogger("flover.http")


def error_response(e: oa.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def from_daemon(e: FloverError) -> oa.ApiError:
    return oa.ApiError(oa.STATUS.get(e.code, 500), e.message, e.code)


def as_api_error(e: BaseException) -> oa.ApiError:
    """Whatever ended a request, as the error its client gets: a bug is a 500, logged here once."""
    if isinstance(e, oa.ApiError):
        return e
    if isinstance(e, FloverError):
        return from_daemon(e)
    log.error("internal error on a request", exc_info=e)
    return oa.ApiError(500, f"internal error: {type(e).__name__}", "internal_error")


async def wait_watching(request: Request, tasks) -> bool:
    """Wait for the first of `tasks` to finish (or fail) while the client stays connected; False
    as soon as it hung up (polled every 50 ms), so that a gone client's requests leave the queue."""
    while True:
        done, _ = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
        if done:
            return True
        if await request.is_disconnected():
            return False


def front_of(request: Request) -> "Front":
    """The app's Front (http_api.build_app puts it in the app's state)."""
    return request.app.state.front


class Front:
    """The app's state: one AsyncClient to the daemon, the tokenizer, the served name."""

    def __init__(
        self,
        engine_addr: str,
        model_name: str,
        tokenizer,
        model_config: ModelConfig,
        api_key: str | None,
        parent_pid: int | None = None,
        curve: tuple[bytes, bytes, bytes] | None = None,
        max_body_bytes: int = MAX_MESSAGE_BYTES,
        reasoning_format: str = "auto",
        engine_timeout: float | None = None,
    ):
        """`parent_pid`: the daemon that started this front; the front stops when it is gone
        (also when it was killed and could not stop the front itself). `curve`: (the daemon's
        public key, this front's public and secret keys) when the socket uses CURVE.
        `max_body_bytes`: larger request bodies are refused (the daemon's message bound)."""
        self.engine_addr, self.model_name, self.tokenizer, self.api_key = engine_addr, model_name, tokenizer, api_key
        self.parent_pid, self.curve, self.max_body_bytes = parent_pid, curve, max_body_bytes
        self.engine_timeout = engine_timeout  # the daemon's silence a request waits out (HttpLimits)
        self.client: AsyncClient | None = None
        self.max_model_len: int | None = None
        self.capabilities: list[str] | None = None  # what the served model does (the daemon's health says)
        self.model_config = model_config
        self._intake: Intake | None = None
        # how this model writes tool calls (from its chat template: flover/tools.py)
        template = tokenizer.chat_template_source if tokenizer is not None else None
        self.tool_syntax = syntax_of(template)
        # chat answers' thinking as reasoning_content: an opening <think> block, or gpt-oss's
        # analysis channel (flover/reasoning.py); "" with --reasoning-format none
        self.reasoning = template_format(template) if reasoning_format == "auto" else ""
        self._background: set[asyncio.Task] = set()
        self.streams: set[asyncio.Queue] = set()  # the event queues of the streamed answers in flight
        # Tokenizing and rendering chat templates cost CPU in proportion to the text: they run
        # here, never on the event loop (the `tokenizers` library releases the GIL while it works).
        self._cpu = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="flover-tokenize", initializer=background_thread
        )
        # Request bodies are parsed one at a time: a flood of large bodies takes at most one core
        # from the engine (two parsing at once doubled the gaps in a running stream).
        self._bodies = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flover-body", initializer=background_thread
        )

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def parse_off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._bodies, fn, *args)

    def end_streams(self, why: str) -> None:
        """The front is stopping: every streamed answer in flight ends with an error event now (a
        client must never read a cut answer as a finished one)."""
        for events in self.streams:
            events.put_nowait((None, oa.ApiError(503, why, "shutting_down")))

    def cancel(self, rids) -> None:
        """Fire-and-forget cancels (also from a generator being torn down by a disconnect)."""
        for rid in rids:
            task = asyncio.get_running_loop().create_task(self.client.cancel(rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def health(self) -> dict:
        health = await self.client.health(timeout=2.0)
        self.max_model_len = health.get("max_seq_len", self.max_model_len)
        self.capabilities = health.get("capabilities", self.capabilities)
        return health

    def intake(self, limit: int | None) -> Intake:
        """The engine's own intake (engine/intake.py) for /tokenize: the same chat rendering,
        bounds and refusals as a request, for the daemon's context length (`limit`, else the
        model's)."""
        max_seq_len = limit or self.model_config.max_position_embeddings
        if self._intake is None or self._intake.max_seq_len != max_seq_len:
            self._intake = Intake(
                self.tokenizer,
                self.model_config,
                max_seq_len,
                GrammarLimits(),
                checks_grammars=False,
                refuse_over_context=False,
            )
        return self._intake

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else f"token_id:{token_id}".encode()


class RequireKey:
    """'Authorization: Bearer KEY' on every path but /health. Plain ASGI on purpose: Starlette's
    BaseHTTPMiddleware wraps `receive` so that handlers no longer see a client disconnect."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refused = oa.ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_api_key")
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "chat_template_kwargs"}


async def read_json(request: Request, limit: int, off_loop, known: set[str]) -> dict:
    """The body as a JSON object, read up to `limit` bytes: a larger one is refused (413) before it
    is buffered, whether it declares its length or streams chunks. Parsed and checked by
    `off_loop` (one worker thread): a megabyte body costs the event loop nothing but the GIL
    while `json` parses it. Fields not in `known` are kept as null (never read: warned about,
    not walked)."""
    too_large = oa.ApiError(
        413, f"the request body is larger than {limit} bytes (the server's --max-message-bytes)", "message_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    raw, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        raw.append(chunk)
    return await off_loop(_parse_body, b"".join(raw), known)


def _parse_body(raw: bytes, known: set[str]) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise oa.ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise oa.ApiError(400, f"the request body nests deeper than {oa.MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise oa.ApiError(400, "the request body must be a JSON object")
    for key in body.keys() - known:
        body[key] = None
    oa.check_json_values(body)
    return body
