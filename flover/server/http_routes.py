"""The HTTP front's routes, one handler each (`ROUTES`; http_api.build_app mounts them). Each reads
the app's `Front` from `request.app.state.front`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from flover.client import FloverError
from flover.engine.intake import PromptTooLong
from flover.server import openai_api as oa
from flover.server.http_embeddings import embeddings, rerank
from flover.server.http_state import (
    TOKENIZE_FIELDS,
    Front,
    as_api_error,
    error_response,
    front_of,
    log,
    read_json,
    wait_watching,
)
from flover.server.prometheus import render
from flover.server.sse import StreamFramer


async def health(request: Request):
    try:
        status = (await front_of(request).health())["status"]
    except (FloverError, asyncio.TimeoutError):
        status = "unreachable"
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


async def metrics(request: Request):
    front = front_of(request)
    try:
        stats = await front.client.stats(timeout=5.0)
    except (FloverError, asyncio.TimeoutError) as e:
        return error_response(oa.ApiError(503, f"the engine did not answer ({e})", "unavailable"))
    return Response(render(stats, front.model_name), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request):
    front = front_of(request)
    await context_length(front)
    return {
        "object": "list",
        "data": [
            {
                "id": front.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "flover",
                "max_model_len": front.max_model_len,
                "capabilities": front.capabilities,
            }
        ],
    }


async def completions(request: Request):
    return await generate(request, "completion")


async def chat_completions(request: Request):
    return await generate(request, "chat")


async def tokenize(request: Request):
    """The ids a request with this prompt (or these messages) would run, through the engine's own
    intake: the same chat template, bounds and refusals."""
    front = front_of(request)
    try:
        body = await read_json(request, front.max_body_bytes, front.parse_off_loop, TOKENIZE_FIELDS)
        if "messages" in body:
            kwargs = oa.template_kwargs(body)
            param, job = "messages", (None, oa.chat_messages(body["messages"]), None, False, kwargs)
        elif isinstance(body.get("prompt"), str):
            special = oa._boolean(body, "add_special_tokens")
            param, job = "prompt", (body["prompt"], None, None, True if special is None else special)
        else:
            raise oa.ApiError(400, "expected prompt (a string) or messages", param="prompt")
        intake = front.intake(await context_length(front))
        try:
            ids, _ = await front.off_loop(intake.tokenize, *job)
        except PromptTooLong as e:
            raise oa.ApiError(400, f"{param}: {e}", "prompt_too_long", param) from None
        except ValueError as e:  # no tokenizer, no chat template, ids outside the vocabulary
            raise oa.ApiError(400, f"{param}: {e}", param=param) from None
    except oa.ApiError as e:
        return error_response(e)
    answer = {"tokens": ids, "count": len(ids), "max_model_len": front.max_model_len}
    return Response(await front.off_loop(json.dumps, answer), media_type="application/json")


async def detokenize(request: Request):
    front = front_of(request)
    try:
        body = await read_json(request, front.max_body_bytes, front.parse_off_loop, {"model", "tokens"})
        if front.tokenizer is None:
            raise oa.ApiError(400, "this checkpoint has no tokenizer", param="tokens")
        ids, vocab = body.get("tokens"), front.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
        ):
            raise oa.ApiError(400, f"tokens: expected a list of token ids in [0, {vocab})", param="tokens")
    except oa.ApiError as e:
        return error_response(e)
    return {"prompt": await front.off_loop(front.tokenizer.decode, ids)}


ROUTES = [
    ("GET", "/health", health),
    ("GET", "/metrics", metrics),
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/embeddings", embeddings),
    ("POST", "/v1/rerank", rerank),
    ("POST", "/rerank", rerank),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
]


# -- helpers ---------------------------------------------------------------------------------------
async def context_length(front: Front) -> int | None:
    if front.max_model_len is None:
        with contextlib.suppress(FloverError, asyncio.TimeoutError):
            await front.health()
    return front.max_model_len


async def encode(front: Front, text: str, limit: int | None, param: str, special: bool = True) -> list[int]:
    """Tokenize off the loop, refusing first (like the daemon) a text too long to fit any context."""
    if front.tokenizer is None:
        raise oa.ApiError(400, f"{param}: this checkpoint has no tokenizer; send token ids", param=param)
    if limit is not None and front.tokenizer.cannot_fit(text, limit):
        raise oa.ApiError(400, f"{param}: too long for the context of {limit} tokens", "prompt_too_long", param)
    return await front.off_loop(front.tokenizer.encode, text, special)


async def tokenize_echoed(front: Front, plan: oa.Plan) -> None:
    """`echo`: the answer lists the prompt's tokens, so the prompt is tokenized here (the ids
    the daemon then runs are the ones listed) and an id prompt's text is decoded."""
    limit = await context_length(front)
    for choice in plan.choices:
        if "prompt" in choice.source:
            choice.source = {"input_ids": await encode(front, choice.source["prompt"], limit, "prompt")}
        elif front.tokenizer is not None:
            ids, vocab = choice.source["input_ids"], front.tokenizer.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise oa.ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            choice.echo = await front.off_loop(front.tokenizer.decode, ids)
        else:
            choice.echo = ""


# -- completions and chats --------------------------------------------------------------------------
async def generate(request: Request, kind: str):
    front = front_of(request)
    try:
        body = await read_json(request, front.max_body_bytes, front.parse_off_loop, oa.NEUTRAL)
        plan = await front.parse_off_loop(
            oa.plan, body, kind, front.model_name, log.warning, front.tool_syntax, front.reasoning
        )
        if plan.echo:  # (chats go to the daemon as messages: it renders and bounds them)
            await tokenize_echoed(front, plan)
    except oa.ApiError as e:
        return error_response(e)
    rids = [f"http-{uuid.uuid4().hex[:12]}-{c.index}" for c in plan.choices]
    if plan.stream:
        return await stream(request, front, plan, rids)
    return await answer(request, front, plan, rids)


async def answer(request: Request, front: Front, plan: oa.Plan, rids: list[str]):
    """One JSON answer once every choice has finished; a client that leaves frees its slots."""
    tasks = [
        asyncio.ensure_future(front.client.generate(**c.source, request_id=rid, **c.params))
        for c, rid in zip(plan.choices, rids)
    ]
    try:
        while True:
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            pending = [t for t in tasks if not t.done()]
            if not pending:
                return oa.response(plan, front.model_name, [t.result() for t in tasks], front.token_bytes)
            if not await wait_watching(request, pending):
                return JSONResponse({}, status_code=499)  # nobody reads it
    except Exception as e:  # the daemon's refusal, or anything else: this request ends here
        return error_response(as_api_error(e))
    finally:
        unfinished = [rid for t, rid in zip(tasks, rids) if not t.done() or t.cancelled() or t.exception()]
        for t in tasks:
            t.cancel()
        front.cancel(unfinished)


async def stream(request: Request, front: Front, plan: oa.Plan, rids: list[str]):
    """Server-sent events (sse.StreamFramer frames them). An error before any token is still an
    HTTP status; a client that hangs up while its requests wait in the queue takes them out."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, rid: str, choice: oa.Choice) -> None:
        try:
            async for event in front.client.stream(**choice.source, request_id=rid, **choice.params):
                events.put_nowait((index, event))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # whatever ends a pump reaches the handler: it never waits forever
            events.put_nowait((index, as_api_error(e)))

    pumps = [asyncio.ensure_future(pump(c.index, rid, c)) for c, rid in zip(plan.choices, rids)]
    framer = StreamFramer(plan, front.model_name, front.token_bytes)
    front.streams.add(events)

    def stop() -> None:
        front.streams.discard(events)
        for task in pumps:
            task.cancel()
        front.cancel([rid for i, rid in enumerate(rids) if i not in framer.finished])

    waiting = asyncio.ensure_future(events.get())
    try:
        connected = await wait_watching(request, [waiting])
    finally:
        if not waiting.done():
            waiting.cancel()
    if not connected:
        stop()
        return JSONResponse({}, status_code=499)  # nobody reads it
    first = waiting.result()
    if isinstance(first[1], oa.ApiError):
        framer.finished.add(first[0])
        stop()
        return error_response(first[1])

    async def body():
        item = first
        try:
            while True:
                for frame in framer.frames(*item):
                    yield frame
                if framer.done:
                    return
                item = await events.get()
        finally:  # also when the client disconnects: its requests are cancelled
            stop()

    return StreamingResponse(body(), media_type="text/event-stream")
