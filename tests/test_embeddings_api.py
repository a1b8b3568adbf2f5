"""Embeddings and rerank through a real `flover serve --http`: the official `openai` client, raw
HTTP for rerank, the ZeroMQ `embed` op; chats served by the same daemon meanwhile."""

from __future__ import annotations

import asyncio
import base64
import json
import signal

import httpx
import numpy as np
import openai
import pytest

from flover import LLM
from flover.client import FloverError
from flover.testing.embedding_model import as_sentence_transformer, make_tiny_bert
from tests.helpers import Server, flover_run, flover_run_ok, free_port, read_records, write_jsonl

TEXTS = ["the cat sat on the mat", "a river runs through the city", "hi", "red blue green yellow " * 5]


@pytest.fixture(scope="module")
def model_dir(make_model, tmp_path_factory):
    return str(as_sentence_transformer(make_model("qwen3"), tmp_path_factory.mktemp("st-qwen3"), "last"))


@pytest.fixture(scope="module")
def api(model_dir):
    port = free_port()
    server = Server(model_dir, "--max-slots", "4", "--max-seq-len", "128", "--http", f"127.0.0.1:{port}")
    yield server, f"http://127.0.0.1:{port}"
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(model_dir, dtype="float64", max_seq_len=128)


def test_openai_client_embeddings_equal_the_offline_vectors(api, offline):
    _, url = api
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert {"embeddings", "rerank", "chat"} <= set(model["capabilities"])
    answer = client.embeddings.create(model=model["id"], input=TEXTS)
    want = np.array([o.embedding for o in offline.embed(TEXTS)])
    got = np.array([d.embedding for d in sorted(answer.data, key=lambda d: d.index)])
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-6  # (the client asks float32 in base64)
    floats = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60).json()["data"]
    assert np.abs(np.array([d["embedding"] for d in floats]) - want).max() < 1e-12  # (float64 rows of one iteration)
    ids = offline.engine.tokenizer.encode(TEXTS[0])
    assert answer.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline.embed(TEXTS))
    # token ids in, base64 out (float32 little-endian), fewer dimensions
    raw = httpx.post(
        f"{url}/v1/embeddings", json={"input": [ids], "encoding_format": "base64", "dimensions": 8}, timeout=60
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    cut = np.array(offline.embed(ids, dimensions=8)[0].embedding, dtype=np.float32)
    assert vector.shape == (8,) and np.array_equal(vector, cut)


def test_rerank_orders_documents_by_cosine_similarity(api, offline):
    _, url = api
    documents = TEXTS[1:]
    body = {"query": TEXTS[0], "documents": documents, "top_n": 2}
    answer = httpx.post(f"{url}/v1/rerank", json=body, timeout=60).json()
    vectors = np.array([o.embedding for o in offline.embed([TEXTS[0], *documents])])
    cosine = vectors[1:] @ vectors[0] / np.linalg.norm(vectors[1:], axis=1) / np.linalg.norm(vectors[0])
    want = list(np.argsort(-cosine)[:2])
    assert [r["index"] for r in answer["results"]] == want
    assert [r["document"]["text"] for r in answer["results"]] == [documents[n] for n in want]
    assert np.allclose([r["relevance_score"] for r in answer["results"]], cosine[want], atol=1e-9)


def test_bad_embedding_calls_get_a_400_and_the_server_goes_on(api):
    _, url = api
    post = lambda body: httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)  # noqa: E731
    for body, says in [
        ({"input": []}, "input"),
        ({"input": ""}, "empty"),
        ({"input": ["x"] * 2049}, "at most 2048"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 10**6}, "dimensions"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": [list(range(1, 200))]}, "truncate_prompt_tokens"),
        ({"input": "red blue green yellow " * 100}, "truncate_prompt_tokens"),  # (text: tokenized off the loop)
    ]:
        response = post(body)
        assert response.status_code == 400 and says in response.json()["error"]["message"], (body, response.text)
    long = post({"input": [list(range(1, 200))], "truncate_prompt_tokens": 100})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 100
    assert httpx.post(f"{url}/v1/rerank", json={"query": "q", "documents": []}).status_code == 400
    assert post({"input": "x", "model": "another"}).status_code == 404


def test_chats_and_embeddings_share_the_daemon(api):
    server, url = api
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

    async def both():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        chats = [
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"tell me {n}"}], max_tokens=16, temperature=0
            )
            for n in range(3)
        ]
        embeddings = [client.embeddings.create(model=model, input=TEXTS * 4) for _ in range(3)]
        return await asyncio.gather(*chats, *embeddings)

    answers = asyncio.run(both())
    assert all(a.choices[0].finish_reason in ("length", "stop") for a in answers[:3])
    assert all(len(a.data) == 4 * len(TEXTS) for a in answers[3:])
    with server.client() as zmq_client:  # the ZeroMQ op: one input, its final event
        final = zmq_client.embed("the cat sat on the mat", dimensions=4)
        assert len(final["embedding"]) == 4 and final["usage"]["prompt_tokens"] > 0
        with pytest.raises(FloverError, match="dimensions"):
            zmq_client.embed("x", dimensions=65)


def test_a_model_without_pooling_refuses_embed_ops(server):
    with server.client() as client:
        with pytest.raises(FloverError, match="--pooling"):
            client.embed("hello")
        assert client.generate("hello", max_new_tokens=2)["finish_reason"] == "length"


def test_flover_run_embeds_a_file_resumably_and_through_a_daemon(api, model_dir, offline, tmp_path):
    server, _ = api
    lines = [
        {"id": "a", "prompt": TEXTS[0]},
        {"id": "b", "input_ids": [5, 6, 7, 8], "dimensions": 8},
        {"id": "c", "messages": [{"role": "user", "content": "x"}]},  # not an input: its error record
        {"id": "d", "input_ids": list(range(1, 300)), "truncate_prompt_tokens": 64},
        {"id": "e", "input_ids": list(range(1, 300))},  # longer than the context: its error record
    ]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, lines)
    assert flover_run(model_dir, prompts, out, "--embed", "--dtype", "float64").returncode == 0
    first = read_records(out)
    out.write_text("".join(json.dumps(r) + "\n" for r in first[:2]))  # a run cut short: a resume finishes it
    run = flover_run(model_dir, prompts, out, "--embed", "--dtype", "float64")
    assert run.returncode == 0 and "2 already done" in run.stderr, run.stderr
    records = {r["id"]: r for r in read_records(out)}
    assert len(read_records(out)) == 5
    # (float64 runs PyTorch's forward, whose rows may round apart with other rows beside them)
    close = lambda a, b: np.abs(np.array(a) - np.array(b)).max() < 1e-12  # noqa: E731
    assert all(close(records[r["id"]]["embedding"], r["embedding"]) for r in first if "embedding" in r)
    assert close(records["a"]["embedding"], offline.embed(TEXTS[0])[0].embedding)
    assert close(records["b"]["embedding"], offline.embed([5, 6, 7, 8], dimensions=8)[0].embedding)
    assert records["d"]["usage"]["prompt_tokens"] == 64
    assert records["c"]["error"]["code"] == "invalid_request"
    assert records["e"]["error"]["code"] == "prompt_too_long"
    remote = tmp_path / "remote.jsonl"
    connect = ["--connect", server.addr, "--embed"]
    assert flover_run(model_dir, prompts, remote, *connect).returncode == 0
    by_id = {r["id"]: r for r in read_records(remote)}
    assert close(by_id["a"]["embedding"], records["a"]["embedding"])
    assert close(by_id["b"]["embedding"], records["b"]["embedding"])
    assert [by_id[k].get("error", {}).get("code") for k in "cde"] == ["invalid_request", None, "prompt_too_long"]


def test_an_encoder_serves_embeddings_and_refuses_chats(tmp_path):
    model_dir = str(make_tiny_bert(tmp_path / "bert", "mean"))
    port = free_port()
    server = Server(model_dir, "--max-slots", "4", "--max-seq-len", "128", "--http", f"127.0.0.1:{port}")
    try:
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert model["capabilities"] == ["embeddings", "rerank", "score"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        answer = client.embeddings.create(model=model["id"], input=TEXTS, encoding_format="float")
        want = np.array([o.embedding for o in LLM(model_dir, dtype="float64").embed(TEXTS)])
        assert np.abs(np.array([d.embedding for d in answer.data]) - want).max() < 1e-12
        with pytest.raises(openai.BadRequestError, match="not text"):
            client.completions.create(model=model["id"], prompt="hello", max_tokens=4)
    finally:
        server.stop(signal.SIGKILL)


def test_embeddings_under_tensor_parallelism_equal_one_ranks(model_dir, tmp_path):
    """Two ranks (mpirun): the intake carries each input's embedding options to the follower, whose
    scheduler then plans the same iterations; the vectors are one rank's (float64)."""
    prompts = tmp_path / "in.jsonl"
    lines = [{"id": str(n), "prompt": text} for n, text in enumerate(TEXTS)]
    write_jsonl(prompts, [*lines, {"id": "ids", "input_ids": [5, 6, 7, 8], "dimensions": 8}])
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    flover_run_ok(1, model_dir, prompts, one, "--embed")
    flover_run_ok(2, model_dir, prompts, two, "--embed")
    alone, split = ({r["id"]: r["embedding"] for r in read_records(path)} for path in (one, two))
    assert alone.keys() == split.keys() == {"0", "1", "2", "3", "ids"} and len(split["ids"]) == 8
    assert max(np.abs(np.array(alone[k]) - np.array(split[k])).max() for k in alone) < 1e-12
