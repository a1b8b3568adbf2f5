"""OpenAI's `POST /v1/embeddings` and a rerank endpoint (`POST /v1/rerank`, the shape llama.cpp's
server and vLLM answer) over the daemon's `embed` op: one op per input, at most IN_FLIGHT of one
call in the daemon at a time (a call of many inputs never fills the waiting queue that other
clients share), all of them riding the same fused iterations as the chats.

Reranking with a reranker (a cross-encoder) is its score of each (query, document) pair; with an
embedding model, the cosine similarity of the query's vector and each document's (as vLLM scores
with embedding models)."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from flover.config import is_int
from flover.models.pooling import cosine
from flover.server import openai_api as oa
from flover.server.http_state import Front, as_api_error, error_response, front_of, read_json, wait_watching

MAX_INPUTS = 2048  # inputs of one call (OpenAI's own bound)
IN_FLIGHT = 64  # of one call's inputs, sent to the daemon at once
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "truncate_prompt_tokens"}


def _positive(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (not is_int(value) or value < 1):
        raise oa.ApiError(400, f"{name}: expected a positive integer", param=name)
    return value


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(map(is_int, value))


def embedding_inputs(value) -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str) or _is_ids(value):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or _is_ids(v) for v in value):
        inputs = value
    else:
        raise oa.ApiError(
            400, "input: expected a string, a list of strings, or (lists of) token ids, none empty", param="input"
        )
    if len(inputs) > MAX_INPUTS:
        raise oa.ApiError(400, f"input: {len(inputs)} inputs; at most {MAX_INPUTS} in one call", param="input")
    if any(i == "" for i in inputs):
        raise oa.ApiError(400, "input: an input is an empty string", param="input")
    return inputs


async def embed_all(request: Request, front: Front, calls: list[dict]) -> list[dict] | None:
    """Each embed op's final event, in order (`calls`: each op's fields, `input` and options;
    None: the client hung up); the first refusal raises. At most IN_FLIGHT in the daemon at
    once; whatever is unfinished when this ends is cancelled."""
    prefix = f"http-{uuid.uuid4().hex[:12]}"
    results: list[dict | None] = [None] * len(calls)
    running: dict[asyncio.Future, tuple[int, str]] = {}
    following = iter(enumerate(calls))
    try:
        while True:
            while len(running) < IN_FLIGHT and (item := next(following, None)) is not None:
                n, fields = item
                rid = f"{prefix}-{n}"
                running[asyncio.ensure_future(front.client.embed(request_id=rid, **fields))] = (n, rid)
            if not running:
                return results
            if not await wait_watching(request, list(running)):
                return None
            for task in [t for t in running if t.done()]:
                n, _ = running.pop(task)
                results[n] = task.result()  # (a refusal raises: the call ends with it)
    finally:
        for task in running:
            task.cancel()
        front.cancel([rid for _, rid in running.values()])


def _encoded(vector: list[float], encoding: str):
    if encoding == "base64":  # float32, little-endian (as OpenAI's)
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def embeddings(request: Request):
    front = front_of(request)
    try:
        body = await read_json(request, front.max_body_bytes, front.parse_off_loop, EMBEDDING_FIELDS)
        oa.check_model(body, front.model_name)
        inputs = await front.parse_off_loop(embedding_inputs, body.get("input"))
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise oa.ApiError(400, "encoding_format: expected float or base64", param="encoding_format")
        options = {name: _positive(body, name) for name in ("dimensions", "truncate_prompt_tokens")}
        options = {k: v for k, v in options.items() if v is not None}
        finals = await embed_all(request, front, [{"input": i, **options} for i in inputs])
    except Exception as e:  # the daemon's refusal, or anything else: this call ends here
        return error_response(as_api_error(e))
    if finals is None:
        return JSONResponse({}, status_code=499)  # nobody reads it
    tokens = sum(f["usage"]["prompt_tokens"] for f in finals)
    data = [
        {"object": "embedding", "index": n, "embedding": _encoded(f["embedding"], encoding)}
        for n, f in enumerate(finals)
    ]
    answer = {
        "object": "list",
        "data": data,
        "model": front.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return await front.off_loop(JSONResponse, answer)


async def rerank(request: Request):
    """{query, documents, top_n?, return_documents?} -> results [{index, relevance_score,
    document?}], the most relevant first."""
    front = front_of(request)
    try:
        body = await read_json(request, front.max_body_bytes, front.parse_off_loop, RERANK_FIELDS)
        oa.check_model(body, front.model_name)
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not query:
            raise oa.ApiError(400, "query: expected a non-empty string", param="query")
        if not isinstance(documents, list) or not documents or not all(isinstance(d, str) and d for d in documents):
            raise oa.ApiError(400, "documents: expected a list of non-empty strings", param="documents")
        if len(documents) >= MAX_INPUTS:
            raise oa.ApiError(400, f"documents: at most {MAX_INPUTS - 1} in one call", param="documents")
        top_n = _positive(body, "top_n") or len(documents)
        keep = _positive(body, "truncate_prompt_tokens")
        options = {} if keep is None else {"truncate_prompt_tokens": keep}
        pairs = front.capabilities is not None and "embeddings" not in front.capabilities  # a reranker
        texts = (
            [{"input": query, "document": d} for d in documents]
            if pairs
            else [{"input": query}] + [{"input": d} for d in documents]
        )
        finals = await embed_all(request, front, [{**t, **options} for t in texts])
    except Exception as e:
        return error_response(as_api_error(e))
    if finals is None:
        return JSONResponse({}, status_code=499)
    if pairs:
        scores = [f["embedding"][0] for f in finals]
    else:
        scores = [cosine(finals[0]["embedding"], f["embedding"]) for f in finals[1:]]
    order = sorted(range(len(documents)), key=lambda n: -scores[n])[:top_n]
    with_text = body.get("return_documents", True) is not False
    results = [
        {"index": n, "relevance_score": scores[n], **({"document": {"text": documents[n]}} if with_text else {})}
        for n in order
    ]
    tokens = sum(f["usage"]["prompt_tokens"] for f in finals)
    return {
        "id": f"rerank-{uuid.uuid4().hex[:12]}",
        "model": front.model_name,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
