"""Prompt-lookup speculation: the drafts, their verification, and whole engines that must give
the very tokens they give without it, in fewer iterations."""

from __future__ import annotations

import logging
import random

import pytest

from flover import LLM, SamplingParams
from flover.config import EngineConfig
from flover.engine.output import OutputProcessor
from flover.engine.scheduler import Scheduler, StepPlan
from flover.engine.speculation import (
    DEFAULT_DRAFT_TOKENS,
    Drafting,
    IterationCost,
    NgramLookup,
    Speculation,
    drafts_for,
)
from flover.request import Request, RequestInput, StepResult
from flover.runner.runner import verify


def test_a_draft_is_what_followed_the_latest_earlier_occurrence():
    lookup = NgramLookup(2, [5, 6, 7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2])
    assert lookup.draft(3) == [4, 8, 1]  # "1 2" last seen before the end at index 7: "4 8 1" came next
    assert lookup.draft(0) == []
    assert NgramLookup(2, [1, 2, 3, 4]).draft(3) == []  # "3 4" never occurred before
    assert NgramLookup(3, [1, 2, 3]).draft(2) == []  # nothing before the suffix


def test_a_draft_that_runs_into_the_end_repeats_with_its_period():
    assert NgramLookup(2, [7, 1, 2, 3, 1, 2]).draft(5) == [3, 1, 2, 3, 1]
    assert NgramLookup(1, [4, 4]).draft(3) == [4, 4, 4]


def test_appending_keeps_the_lookup_as_if_built_at_once():
    rng = random.Random(0)
    tokens = [rng.randrange(4) for _ in range(200)]
    grown = NgramLookup(3, tokens[:10])
    for t in range(10, len(tokens)):
        grown.extend(tokens[t : t + 1])
        whole = NgramLookup(3, tokens[: t + 1])
        assert grown.draft(4) == whole.draft(4)
        # and the draft follows the definition: the latest earlier occurrence of the last 3 tokens
        seq, suffix = tokens[: t + 1], tokens[t - 2 : t + 1]
        starts = [s for s in range(len(seq) - 3) if seq[s : s + 3] == suffix]
        if starts:
            after = starts[-1] + 3
            assert whole.draft(1) == [seq[after]]
        else:
            assert whole.draft(1) == []


def test_verification_accepts_the_longest_matching_prefix_and_the_id_after_it():
    # request 0: draft [5, 6, 7], rows give [5, 6, 9, x]: 5 and 6 accepted, then 9
    # request 1: draft [3], rows give [4, 3]: nothing accepted
    # request 2: no draft (a prompt that completed this iteration): its one row
    firsts, more = verify([[5, 6, 7], [3]], [5, 6, 9, 11, 4, 3, 8], 3)
    assert firsts == [5, 4, 8]
    assert more == {0: [6, 9]}
    firsts, more = verify([[1, 2]], [1, 2, 3], 1)  # all accepted: three tokens
    assert (firsts, more) == ([1], {0: [2, 3]})


def request(i: int, prompt: list[int], outputs: list[int], max_new: int, **params) -> Request:
    r = Request(str(i), prompt, SamplingParams(max_new_tokens=max_new, **params))
    r.output_token_ids = list(outputs)
    return r


def test_drafts_stay_within_the_budget_and_what_each_request_may_still_produce():
    loop = [1, 2, 3] * 5
    requests = [
        request(0, loop, [1], 50),
        request(1, loop, [1], 3),
        request(2, loop, [1], 50, temperature=0.7),
        request(3, loop, [1], 50, logprobs=True),
        request(4, loop, [1], 50),
    ]
    drafts = drafts_for(requests, Speculation(tokens=4, ngram=2), budget=6, min_acceptance=0.01)
    assert drafts[0] == [2, 3, 1, 2]
    assert drafts[1] == [2]  # 3 new tokens at most, 1 made: the verifier's own token is the third
    assert drafts[2] == drafts[3] == []  # sampled, or asking for log-probabilities: no drafts
    assert drafts[4] == [2]  # what the budget leaves
    assert sum(map(len, drafts)) == 6


def test_a_draft_takes_the_tokens_likely_enough_to_be_accepted():
    """With q a request's acceptance per token so far, draft token i is accepted with chance
    q^i: the draft takes the tokens above the line; a request below it tries again later."""
    state = Drafting(NgramLookup(1))
    assert state.length(0.05, 8) == 8  # nothing seen: q = 3/4, 0.75^8 > 0.05
    assert state.length(0.6, 8) == 1 and state.length(0.8, 8) == 0  # 0.75 > 0.6 > 0.75^2
    state.learn(drafted=4, accepted=4)  # all 4 accepted: q = 5.3 / 5.8
    assert state.length(0.6, 8) == 5  # 0.914^5 > 0.6 > 0.914^6
    for _ in range(5):  # five drafts of 4 that each ended at their first token
        state.learn(drafted=4, accepted=0)
    assert state.length(0.5, 8) == 0 and state.length(0.05, 8) == 2
    iterations = 0
    while state.length(0.5, 8) == 0:  # no drafts: the rejections fade
        state.learn(drafted=0, accepted=0)
        iterations += 1
    assert 5 < iterations < 20


def test_the_iteration_cost_fit_finds_where_rows_double_an_iteration():
    cost = IterationCost()
    assert cost.knee == IterationCost.DEFAULT_KNEE
    for rows in [1, 40, 8, 32, 3, 64] * 5:
        cost.observe(rows, 0.006 + 0.0003 * rows)
    assert cost.knee == pytest.approx(20, rel=1e-6)
    for _ in range(400):  # the machine got slower per row: older iterations fade
        for rows in (1, 33):
            cost.observe(rows, 0.006 + 0.0006 * rows)
    assert cost.knee == pytest.approx(10, rel=0.01)


def test_the_scheduler_drafts_only_in_the_budget_prompts_leave():
    scheduler = Scheduler(max_slots=4, max_batch_tokens=12, speculation=Speculation(tokens=4, ngram=2))
    decoding = request(0, [1, 2, 3] * 4, [1], 100)
    scheduler.add(decoding)
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(), now=0.0)  # its whole prompt (12 tokens) in the first iteration
    scheduler.add(request(1, list(range(40, 50)), [], 100))
    plan = scheduler.schedule()
    assert plan.decode == [decoding] and plan.prefill[0].length == 10
    assert plan.drafts == [[2]]  # 12 - 1 decode - 10 prompt tokens
    assert plan.num_tokens == 12


@pytest.fixture(scope="module")
def prompts():
    """Prompts with repeats in them (drafts from the start) and without; the small random model
    soon repeats itself either way."""
    rng = random.Random(3)
    looped = [[rng.randrange(512) for _ in range(5)] * 4 for _ in range(3)]
    plain = [[rng.randrange(512) for _ in range(n)] for n in (1, 7, 30)]
    return looped + plain


def generate(model_dir: str, prompts, params, runs: bool = False, **config) -> tuple[list, LLM]:
    """Every prompt through one engine (4 slots: they free and refill), stepped here so that each
    request's streamed new tokens can be checked to add up to its final tokens. `runs`: instead
    of the outputs, each request's new tokens of every iteration."""
    llm = LLM(model_dir, max_slots=4, max_seq_len=256, **config)
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed, chunks, finals = {i: [] for i in ids}, {i: [] for i in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            chunks[out.request_id].append(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    for i in ids:
        assert streamed[i] == finals[i].token_ids
    return [chunks[i] if runs else finals[i] for i in ids], llm


@pytest.mark.parametrize("variant", ["llama", "mistral-window8", "llama-mqa-bias-tied-llama3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_gives_the_tokens_of_decoding_one_at_a_time(make_model, prompts, variant, dtype):
    model = make_model(variant)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    plain, off = generate(model, prompts, params, dtype=dtype, speculate=0)
    fast, on = generate(model, prompts, params, dtype=dtype, speculate=4, speculate_ngram=1)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in plain]
    engine = on.engine
    assert engine.runner.native is not None and engine.runner.native.iterations == engine.iterations
    assert engine.accepted_tokens > 10  # it did speculate, and gained
    if variant == "llama":  # (the tied model soon repeats one token: every draft is right)
        assert engine.draft_tokens - engine.accepted_tokens > 30  # wrong drafts too: their rows' K/V is stale
    assert engine.iterations < off.engine.iterations


def test_stops_end_a_speculating_request_where_they_would_have(llama_dir, prompts):
    base = SamplingParams(max_new_tokens=60, ignore_eos=True)
    plain, _ = generate(llama_dir, prompts, base, speculate=0)
    tokenizer = LLM(llama_dir).tokenizer
    token_stops = [base.with_updates(stop_token_ids=(out.token_ids[25],)) for out in plain]
    token_stops[1] = base.with_updates(max_new_tokens=23)
    string_stops = [base.with_updates(stop=(tokenizer.decode(out.token_ids[30:32]),)) for out in plain]
    for params in (token_stops, string_stops):
        without, _ = generate(llama_dir, prompts, params, speculate=0)
        with_drafts, llm = generate(llama_dir, prompts, params, speculate=6, speculate_ngram=1)
        assert llm.engine.accepted_tokens > 0
        assert [(o.token_ids, o.text, o.finish_reason) for o in with_drafts] == [
            (o.token_ids, o.text, o.finish_reason) for o in without
        ]
    assert len(without[1].token_ids) < 60


@pytest.mark.parametrize("stop", ["token", "string", "length"])
def test_a_stop_inside_the_accepted_tokens_ends_the_request_there(llama_dir, stop):
    """The tokens an accepted draft gives are recorded one by one: the first that finishes the
    request is its last, and nothing after it is kept or streamed. (On the small random model
    an accepted token always repeated an earlier output token, which would have stopped the
    request before: this drives the output processor with such tokens directly.)"""
    engine = LLM(llama_dir).engine
    tokenizer = engine.tokenizer
    text = tokenizer.decode([40, 41, 42])
    params = {
        "token": SamplingParams(max_new_tokens=50, stop_token_ids=(42,)),
        "string": SamplingParams(max_new_tokens=50, stop=(tokenizer.decode([41, 42]),)),
        "length": SamplingParams(max_new_tokens=3),
    }[stop]
    r = engine.make_request(RequestInput([1, 2, 3], params))
    result = StepResult(sampled=[r], token_ids=[40], accepted={0: [41, 42, 43, 44]})
    out = OutputProcessor(tokenizer).emit(engine.scheduler.update(StepPlan(), result, now=1.0), now=1.0)[0]
    assert out.finished and out.finish_reason == ("length" if stop == "length" else "stop")
    assert out.token_ids == out.new_token_ids == [40, 41, 42]
    if stop == "string":
        assert out.text == text[: text.index(params.stop[0])]


def test_sampled_and_logprob_requests_share_iterations_with_drafting_ones(llama_dir, prompts):
    """Only plain greedy requests draft; seeded sampling and log-probabilities beside them give
    what they give without speculation."""
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    params = {
        0: greedy,
        2: greedy,
        3: greedy.with_updates(temperature=0.8, seed=7),
        4: greedy.with_updates(logprobs=True, top_logprobs=2),
        5: greedy.with_updates(prompt_logprobs=True),
        1: greedy.with_updates(repetition_penalty=1.3),
    }
    order = [3, 0, 4, 1, 5, 2]  # the drafting requests (0, 2) share iterations with the others
    ps, pp = [prompts[i] for i in order], [params[i] for i in order]
    without, _ = generate(llama_dir, ps, pp, speculate=0)
    with_drafts, llm = generate(llama_dir, ps, pp, speculate=4, speculate_ngram=2)
    assert llm.engine.accepted_tokens > 0
    for a, b in zip(with_drafts, without):
        assert a.token_ids == b.token_ids
        if b.logprobs is not None:
            assert a.logprobs == pytest.approx(b.logprobs) and a.top_logprobs == b.top_logprobs
        if b.prompt_logprobs is not None:
            assert a.prompt_logprobs == pytest.approx(b.prompt_logprobs)


def test_the_prefix_cache_keeps_only_the_accepted_positions(llama_dir, prompts):
    """A finished request's sequence goes to the prefix cache; rejected draft rows wrote K/V
    beyond it. A later prompt that continues the sequence reuses the cached blocks and must
    decode as a fresh engine does."""
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    llm = LLM(llama_dir, max_slots=4, max_seq_len=256, speculate=4, speculate_ngram=2)
    first = llm.generate(prompts[0], params)[0]
    assert llm.engine.draft_tokens > llm.engine.accepted_tokens > 0
    longer = prompts[0] + first.token_ids[:40]
    again = llm.generate(longer, params)[0]
    assert again.cached_tokens >= 48
    fresh = LLM(llama_dir, max_slots=4, max_seq_len=256, prefix_cache_mib=0, speculate=0).generate(longer, params)[0]
    assert again.token_ids == fresh.token_ids


def test_speculation_is_off_where_the_native_step_is_not(llama_dir, prompts, caplog):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    with caplog.at_level(logging.WARNING):
        outs, llm = generate(llama_dir, prompts, params, speculate=4, native_forward="off")
    assert "speculation off" in caplog.text and "native step is off" in caplog.text
    assert llm.engine.draft_tokens == 0
    plain, _ = generate(llama_dir, prompts, params, speculate=0, native_forward="off")  # the same forward
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_speculation_is_on_by_default_where_the_engine_can_and_quietly_off_elsewhere(llama_dir, caplog):
    with caplog.at_level(logging.INFO):
        assert LLM(llama_dir, dtype="float32").engine.scheduler.speculation.tokens == DEFAULT_DRAFT_TOKENS
        assert LLM(llama_dir, dtype="float32", speculate=0).engine.scheduler.speculation.tokens == 0
        assert LLM(llama_dir, dtype="float64").engine.scheduler.speculation.tokens == 0  # PyTorch's forward
    assert "speculation off" not in caplog.text


@pytest.mark.parametrize("changes", [dict(speculate=-1), dict(speculate=65), dict(speculate_ngram=0)])
def test_bad_speculation_settings_are_refused(changes):
    with pytest.raises(ValueError, match="speculate"):
        EngineConfig(model="m", **changes).validate()


def test_a_speculating_daemon_streams_the_tokens_of_one_at_a_time(llama_dir, prompts):
    """`flover serve --speculate`: real clients stream several tokens per event at times, and
    get what the offline API gives without speculation; the stats count drafts and acceptances."""
    from tests.helpers import Server

    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    expected, _ = generate(llama_dir, prompts, params, dtype="float32", speculate=0)
    server = Server(llama_dir, "--max-slots", "4", "--dtype", "float32", "--speculate", "4", "--speculate-ngram", "1")
    try:
        with server.client() as c:
            for i, prompt in enumerate(prompts):
                c.send(
                    {
                        "op": "generate",
                        "id": str(i),
                        "input_ids": prompt,
                        "stream": True,
                        "params": {"max_new_tokens": 60, "ignore_eos": True},
                    }
                )
            streamed, finals = {}, {}
            while len(finals) < len(prompts):
                event = c.next_any(timeout=60)
                assert event is not None and event["event"] in ("token", "final"), event
                if event["event"] == "token":
                    streamed.setdefault(event["id"], []).extend(event["token_ids"])
                else:
                    finals[event["id"]] = event
            stats = c.stats()
    finally:
        server.stop()
    for i, exp in enumerate(expected):
        assert streamed[str(i)] == exp.token_ids
        assert finals[str(i)]["usage"]["completion_tokens"] == len(exp.token_ids)
    assert stats["draft_tokens"] > stats["accepted_tokens"] > 0
