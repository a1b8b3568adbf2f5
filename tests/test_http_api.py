"""The OpenAI-compatible HTTP API: a real `flover serve --http` process, the official `openai`
client (sync and async), and raw HTTP where the client hides what is checked."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.helpers import MPIRUN, Server, free_port


@pytest.fixture(scope="module")
def api(make_model):
    port = free_port()
    server = Server(make_model("llama"), "--max-slots", "8", "--max-seq-len", "512", "--http", f"127.0.0.1:{port}")
    yield server, f"http://127.0.0.1:{port}"
    server.stop(signal.SIGKILL)


def model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def test_models_and_health(api):
    server, url = api
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    assert models["data"][0]["max_model_len"] == 512
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=7, top_p=0.9)])
def test_streamed_text_equals_the_answer_and_finish_reason_comes_last(api, sampling):
    _, url = api
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model = model_id(url)
    whole = client.completions.create(model=model, prompt="Hello the cat", max_tokens=12, **sampling)
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hello the cat",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in text_chunks]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=8, **sampling
    )
    streamed = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=8, stream=True, **sampling
        )
    )
    assert chat.choices[0].message.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert streamed[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in streamed][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in streamed[:-1])
    assert not any(c.usage for c in streamed)  # no usage chunk unless asked
    # Without max_tokens a chat answers up to the context's end (OpenAI's default), not 16 tokens.
    long = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}, **sampling
    )
    assert long.usage.prompt_tokens + long.usage.completion_tokens == 512


def test_n_samples_and_every_prompt_form(api):
    _, url = api
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model = model_id(url)
    three = client.completions.create(model=model, prompt="one two", max_tokens=6, n=3, temperature=1.0, seed=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.text for c in three.choices}) > 1  # different samples (seeds 3, 4, 5)
    again = client.completions.create(model=model, prompt="one two", max_tokens=6, n=3, temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]  # each reproducible
    assert (
        three.usage.prompt_tokens
        == client.completions.create(model=model, prompt="one two", max_tokens=1).usage.prompt_tokens
    )
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "one two"}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="one two", max_tokens=5, temperature=0)
    for prompt in (ids, [ids, ids], ["one two", "one two"]):
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
        assert [c.text for c in answer.choices] == [by_text.choices[0].text] * (1 if prompt is ids else 2)
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"].strip() == "one two"


def test_bad_input_is_a_400_and_the_server_keeps_serving(api):
    _, url = api
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = model_id(url)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=model, prompt="x", max_tokens=2, top_p=7.0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="tools"):  # tools are taken, a malformed one is not
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            tools=[{"type": "function", "function": {"name": "no spaces", "parameters": {}}}],
        )
    with pytest.raises(openai.BadRequestError, match="prompt_too_long|max_seq_len|too long"):
        client.completions.create(model=model, prompt=[1] * 600, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for body in (b"{not json", b"[1, 2]", b'"text"'):
            raw = httpx.post(f"{url}{path}", content=body)
            assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error", (path, body)
    with pytest.raises(openai.BadRequestError):  # a streamed request's error is still a status
        list(client.completions.create(model=model, prompt="x", max_tokens=2, stream=True, temperature=-1))
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=model, prompt="x", max_tokens=2, presence_penalty=3.0)
    plain = client.completions.create(model=model, prompt="x", max_tokens=40, temperature=0)
    penalised = client.completions.create(
        model=model, prompt="x", max_tokens=40, temperature=0, presence_penalty=2.0, frequency_penalty=1.0
    )
    assert penalised.choices[0].text != plain.choices[0].text  # honoured, not ignored
    ok = client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"no_such_field": 1})
    assert ok.choices[0].finish_reason == "length"


def test_a_body_over_the_message_bound_is_a_413_before_it_is_read(api):
    """The front reads at most --max-message-bytes (1 MiB here) of a body, whether the length is
    declared or the body is streamed in chunks; the server keeps serving."""
    import socket

    _, url = api
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # declares 5 MB, sends none of it
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000000\r\n\r\n"
        )
        answer = b""
        while b"}}" not in answer:  # the status line and headers, then the JSON error
            got = sock.recv(65536)
            if not got:
                break
            answer += got
    answer = answer.decode("latin-1")
    assert answer.startswith("HTTP/1.1 413") and "message_too_large" in answer, answer[:400]

    def chunks():  # no Content-Length: chunked transfer, 64 KiB at a time, just over the bound
        piece = b"x" * 65536
        yield b'{"prompt": "'
        for _ in range(16):
            yield piece
        yield b'"}'

    refused = httpx.post(f"{url}/tokenize", content=chunks(), timeout=30)
    assert refused.status_code == 413 and "larger than 1048576 bytes" in refused.json()["error"]["message"]
    fits = httpx.post(f"{url}/tokenize", json={"prompt": "one two " * 100}, timeout=60)  # fits the context
    assert fits.status_code == 200 and fits.json()["count"] > 0
    ok = httpx.post(f"{url}/v1/completions", json={"model": model_id(url), "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_the_async_client_streams_many_at_once(api):
    _, url = api

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        model = model_id(url)

        async def one(i: int) -> tuple[str, str]:
            stream = await client.completions.create(
                model=model, prompt=f"number {i}", max_tokens=10, temperature=0, stream=True
            )
            streamed = "".join([c.choices[0].text async for c in stream if c.choices])
            whole = await client.completions.create(model=model, prompt=f"number {i}", max_tokens=10, temperature=0)
            return streamed, whole.choices[0].text

        for streamed, whole in await asyncio.gather(*(one(i) for i in range(6))):
            assert streamed == whole

    asyncio.run(asyncio.wait_for(main(), 120))


def stats(server) -> dict:
    with server.client() as c:
        return c.stats()


def wait_idle(server) -> dict:
    deadline = time.time() + 10
    while (now := stats(server))["in_flight"] and time.time() < deadline:
        time.sleep(0.05)
    return now


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slots(api, stream):
    """8 choices of 500 tokens take the tiny model ~1 s at least; the client leaves after the
    first chunk (streamed) or 0.2 s (not streamed): all 8 end cancelled, none completes."""
    server, url = api
    body = {"model": model_id(url), "prompt": "x", "max_tokens": 500, "ignore_eos": True, "n": 8, "stream": stream}
    before = wait_idle(server)
    if stream:
        with httpx.Client(timeout=30) as h, h.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first chunk: the requests run
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.2)
    after = wait_idle(server)
    assert after["in_flight"] == 0
    assert after["cancelled"] - before["cancelled"] == 8
    assert after["completed"] == before["completed"]


def test_the_api_key_guards_everything_but_health(make_model):
    port = free_port()
    server = Server(make_model("llama"), "--http", f"127.0.0.1:{port}", "--api-key", "s3cret")
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/v1/models", "/tokenize"):
            refused = httpx.request("GET" if path == "/v1/models" else "POST", f"{url}{path}", json={"prompt": "x"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list().data
    finally:
        assert server.stop()[0] == 0


def test_http_port_in_use_is_one_line(make_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        import subprocess
        import sys

        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "flover.apps.cli",
                "serve",
                "--model",
                make_model("llama"),
                "--bind",
                f"tcp://127.0.0.1:{free_port()}",
                "--http",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith(f"flover: error: cannot serve HTTP on 127.0.0.1:{port}")


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun")
@pytest.mark.parametrize("layout", [(), ("--pp", "2")], ids=["tp2", "pp2"])
def test_under_mpirun_rank_0_serves_http_with_the_tp1_answer(api, make_model, layout):
    """Two tensor-parallel ranks, or two pipeline stages (the prompt's scored rows cross both)."""
    _, url = api
    port = free_port()
    server = Server(make_model("llama"), "--max-seq-len", "512", "--http", f"127.0.0.1:{port}", *layout, ranks=2)
    try:
        body = {"prompt": "Hello the cat", "max_tokens": 10, "temperature": 0, "echo": True, "logprobs": 3}
        tp2 = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        tp1 = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert tp2["choices"][0]["text"] == tp1["choices"][0]["text"]  # float64: exact
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as events:
            lines = [line[6:] for line in events.iter_lines() if line.startswith("data: {")]
        assert "".join(json.loads(line)["choices"][0]["text"] for line in lines) == tp1["choices"][0]["text"]
        # the prompt's logprobs are gathered over the vocabulary blocks of both ranks
        two, one = tp2["choices"][0]["logprobs"], tp1["choices"][0]["logprobs"]
        assert two["tokens"] == one["tokens"] and two["token_logprobs"][0] is None
        assert two["token_logprobs"][1:] == pytest.approx(one["token_logprobs"][1:], abs=1e-9)
        assert [sorted(d) for d in two["top_logprobs"][1:]] == [sorted(d) for d in one["top_logprobs"][1:]]
    finally:  # SIGUSR1: mpirun forwards it and the leader drains, then stops its HTTP front
        assert server.stop(signal.SIGUSR1)[0] == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def scrape(url: str) -> dict:
    """{(sample name, labels without model_name): value} of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def test_metrics_parse_and_count_what_was_sent(api):
    server, url = api
    wait_idle(server)
    before = scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    answers = [
        client.completions.create(
            model=model_id(url), prompt=f"count {i}", max_tokens=5 + i, temperature=0, extra_body={"ignore_eos": True}
        )
        for i in range(4)
    ]
    after = scrape(url)
    delta = lambda name, labels=(): after[(name, labels)] - before.get((name, labels), 0)  # noqa: E731
    assert delta("flover:prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert delta("flover:generation_tokens_total") == sum(a.usage.completion_tokens for a in answers) == 5 + 6 + 7 + 8
    assert delta("flover:request_success_total", (("finished_reason", "length"),)) == 4
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "time_per_output_token_seconds",
    ):
        assert delta(f"flover:{name}_count") == 4
        assert after[(f"flover:{name}_bucket", (("le", "+Inf"),))] == after[(f"flover:{name}_count", ())]
    # one decode token per iteration after the first: 4 + 5 + 6 + 7 gaps between successive tokens
    assert delta("flover:inter_token_latency_seconds_count") == 4 + 5 + 6 + 7
    assert delta("flover:iteration_time_seconds_count") == delta("flover:iterations_total") > 0
    assert delta("flover:iteration_tokens_sum") == sum(
        a.usage.prompt_tokens + a.usage.completion_tokens - 1 for a in answers
    )
    assert after[("flover:num_requests_running", ())] == 0 and after[("flover:kv_slots_total", ())] == 8
    assert (
        delta("flover:spec_decode_num_draft_tokens_total") == delta("flover:spec_decode_num_accepted_tokens_total") == 0
    )
    with server.client() as c:  # the same numbers over the socket
        stats = c.stats()
    assert stats["metrics"]["generation_tokens"] == after[("flover:generation_tokens_total", ())]
    # which kernels the native step runs, as an info metric (this float64 server runs PyTorch: none)
    from prometheus_client.parser import text_string_to_metric_families

    from flover.server.prometheus import render

    assert stats["native_kernels"] is None and not any(name == "flover:native_kernels_info" for name, _ in after)
    text = render({**stats, "native_kernels": "AVX2+FMA"}, "m").decode()
    samples = [
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "flover:native_kernels_info"
    ]
    assert [(s.labels["kernels"], s.value) for s in samples] == [("AVX2+FMA", 1.0)]


def test_flover_bench_measures_any_openai_endpoint(api, tmp_path):
    """`flover bench --endpoint` against flover's own HTTP front (the same code path a
    llama-server or vLLM URL takes): every request streamed, every token counted."""
    import json
    import subprocess
    import sys

    server, url = api
    before = stats(server)["completed"]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "flover.apps.cli",
            "bench",
            "--endpoint",
            f"{url}/v1",
            "--requests",
            "4",
            "--prompt-len",
            "8",
            "--gen-len",
            "6",
            "--arrival",
            "interval",
            "--interval-ms",
            "20",
            "--vocab-size",
            "500",
            "--out",
            str(tmp_path),
            "--name",
            "ep",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "ep.json").read_text())
    summary = result["results"]["endpoint"]["summary"]
    assert summary["requests"] == 4 and summary["output_tokens"] == 24
    assert all(r["output_tokens"] == 6 and r["prompt_tokens"] == 8 for r in result["results"]["endpoint"]["requests"])
    assert result["meta"]["model"] == model_id(url) and summary["ttft_p50_s"] > 0
    assert stats(server)["completed"] == before + 4
    assert "| endpoint |" in run.stdout


def test_echo_and_logprobs_equal_engine_score(api, make_model):
    """What lm-evaluation-harness asks for likelihoods (`echo` + `logprobs: k`, max_tokens 1 or
    0): the prompt's token logprobs and top-k equal teacher-forced `Engine.score` (float64, the
    server's dtype); generated tokens' too; streamed logprobs equal the answer's."""
    import torch

    from flover import LLM, SamplingParams

    _, url = api
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = model_id(url)
    llm = LLM(make_model("llama"), dtype="float64", max_seq_len=512)
    prompt = "Hello the cat runs fast over the river"
    ids = llm.tokenizer.encode(prompt)
    generated = llm.generate([ids], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids
    logp = torch.log_softmax(llm.engine.score(ids + generated), dim=-1)  # [len, vocab]
    piece = lambda t: llm.tokenizer.token_bytes(t).decode("utf-8", errors="replace")  # noqa: E731

    scored = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [piece(t) for t in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [float(logp[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-9)
    for p in range(1, len(ids)):
        top = logp[p - 1].topk(3)
        expected = {piece(t): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        expected.setdefault(piece(ids[p]), want[p - 1])  # the prompt's own token is always listed
        assert lp.top_logprobs[p] == pytest.approx(expected, abs=1e-9)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]

    both = client.completions.create(
        model=model, prompt=ids, echo=True, logprobs=2, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    lp = both.choices[0].logprobs
    assert both.choices[0].text == llm.tokenizer.decode(ids) + llm.tokenizer.decode(generated)
    rows = range(len(ids) - 1, len(ids) - 1 + len(generated))
    assert lp.tokens == [piece(t) for t in ids + generated]
    assert lp.token_logprobs[1:] == pytest.approx(want + [float(logp[r, t]) for r, t in zip(rows, generated)], abs=1e-9)
    # lm-evaluation-harness: max_tokens 1, the continuation's logprobs are [ctxlen:-1]
    context = llm.tokenizer.encode("Hello the cat")
    harness = client.completions.create(model=model, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    continuation = harness.choices[0].logprobs.token_logprobs[len(context) : -1]
    assert sum(continuation) == pytest.approx(
        float(sum(logp[p - 1, ids[p]] for p in range(len(context), len(ids)))), abs=1e-9
    )

    streamed = list(
        client.completions.create(
            model=model,
            prompt=ids,
            echo=True,
            logprobs=2,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for piece_ in pieces for t in piece_.tokens] == lp.tokens
    assert [v for piece_ in pieces for v in piece_.token_logprobs] == lp.token_logprobs
    assert [o for piece_ in pieces for o in piece_.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in streamed) == both.choices[0].text

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-12 for entry in content)  # greedy: the best
    chat_ids = llm.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    answer = llm.generate([chat_ids], SamplingParams(max_new_tokens=4))[0].token_ids
    assert [bytes(entry.bytes) for entry in content] == [llm.tokenizer.token_bytes(t) for t in answer]
    chat_logp = torch.log_softmax(llm.engine.score(chat_ids + answer), dim=-1)
    assert [e.logprob for e in content] == pytest.approx(
        [float(chat_logp[len(chat_ids) - 1 + i, t]) for i, t in enumerate(answer)], abs=1e-9
    )
    stream = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            stream=True,
        )
    )
    assert [e.logprob for c in stream if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in content], abs=1e-12
    )

    for bad in (dict(logprobs=21), dict(logprobs=True), dict(max_tokens=0), dict(extra_body={"top_logprobs": 2})):
        with pytest.raises(openai.BadRequestError, match="logprobs|max_tokens"):
            client.completions.create(model=model, prompt=prompt, **{"max_tokens": 2, **bad})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2, top_logprobs=2
        )


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_metrics_count_them(api):
    server, url = api
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = model_id(url)
    wait_idle(server)
    before = scrape(url)
    prompt = [(11 * i) % 500 + 1 for i in range(70)]  # 4 whole blocks of 16 within the first 69 tokens
    first = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    assert second.choices[0].text == first.choices[0].text  # float64: the cache changes nothing
    after = scrape(url)
    key = lambda name: (f"flover:{name}_total", ())  # noqa: E731
    assert after[key("prefix_cache_hits")] - before[key("prefix_cache_hits")] == 64
    assert after[key("prefix_cache_lookups")] - before[key("prefix_cache_lookups")] == 2
    assert after[key("prefix_cache_lookup_hits")] - before[key("prefix_cache_lookup_hits")] == 1


def test_the_http_front_never_imports_torch(llama_dir):
    """The front is a process of its own beside the engine: what it imports is what it holds
    resident (torch alone ~150 MB). It reads the checkpoint's tokenizer without torch."""
    code = (
        "import sys; import flover.server.http_api as h; from flover.models import open_checkpoint; "
        "from flover.models.tokenizer import load_tokenizer; "
        f"t = load_tokenizer(open_checkpoint({llama_dir!r})); assert t.encode('hi'); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
