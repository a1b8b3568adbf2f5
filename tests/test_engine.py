"""The engine end to end on a real (tiny, random) checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from flover import LLM, Engine, EngineConfig, SamplingParams
from tests.helpers import run_random_arrivals


def solo_tokens(
    model_dir: str, prompt: list[int], params: SamplingParams, dtype: str = "float64", **options
) -> list[int]:
    llm = LLM(model_dir, dtype=dtype, max_slots=1, max_seq_len=128, **options)
    return llm.generate([prompt], params)[0].token_ids


def random_params(rng: random.Random) -> SamplingParams:
    n = rng.randint(1, 24)
    if rng.random() < 0.5:
        return SamplingParams(max_new_tokens=n, ignore_eos=True)
    return SamplingParams(
        max_new_tokens=n,
        ignore_eos=True,
        temperature=rng.choice([0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 5, 50]),
        top_p=rng.choice([1.0, 0.9]),
        min_p=rng.choice([0.0, 0.05]),
        seed=rng.randrange(2**40),
        frequency_penalty=rng.choice([0.0, 0.5]),
        presence_penalty=rng.choice([0.0, -0.5, 1.0]),
    )


@pytest.mark.parametrize(
    "variant,seed,dtype,quantization",
    [
        ("llama", 0, "float64", "none"),
        ("llama", 1, "float64", "none"),
        ("mistral-window8", 2, "float64", "none"),
        ("gptj", 3, "float64", "none"),
        ("granite", 10, "float64", "none"),  # (its residual and logit scales)
        ("gemma4", 11, "float64", "none"),  # (per-layer inputs, layers reading others' KV, two head shapes)
        ("gemma4-moe", 12, "float64", "none"),  # (experts beside the MLP)
        ("gemma4", 13, "bfloat16", "none"),  # (the native step: two head shapes, shared KV, per-layer inputs)
        # the native step (CPU): every output summed in the same order whatever rows share the
        # iteration, so even float32, bfloat16, int4 and int8 results do not depend on the batch
        ("llama", 4, "float32", "none"),
        ("qwen2", 5, "float32", "none"),
        ("llama", 6, "bfloat16", "none"),
        ("mistral-window8", 7, "bfloat16", "none"),
        ("llama", 8, "bfloat16", "int4"),
        ("qwen2", 9, "bfloat16", "int8"),
        ("llama-head64", 14, "bfloat16", "none"),  # (attention's output wider than hidden and the MLP)
    ],
)
def test_outputs_do_not_depend_on_what_a_request_is_fused_with(make_model, variant, seed, dtype, quantization):
    """Many requests, random arrival iterations, random prompt and output lengths, fewer slots
    than requests and a small token budget (so prompts are chunked and holes appear in the
    middle of the buffer). Each request's tokens must equal its solo run, greedy or seeded."""
    check_fused_equals_solo(make_model(variant), seed, dtype, quantization=quantization)


def check_fused_equals_solo(model_dir: str, seed: int, dtype: str, **options) -> None:
    """test_outputs_do_not_depend_on_what_a_request_is_fused_with's run, with these engine options."""
    rng = random.Random(seed)
    jobs = []
    for i in range(14):
        prompt = [rng.randrange(1, 512) for _ in range(rng.randint(1, 40))]
        jobs.append((rng.randint(0, 30), str(i), prompt, random_params(rng)))
    jobs.sort(key=lambda j: j[0])

    engine = Engine(EngineConfig(model_dir, dtype=dtype, max_slots=4, max_seq_len=128, max_batch_tokens=12, **options))
    assert (engine.runner.native is not None) == (dtype != "float64")
    finals, it, moves_seen, live_seen = {}, 0, 0, set()
    pending = list(jobs)
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= it:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid)
        plan_moves_before = engine.scheduler.num_live
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        live_seen.add(engine.scheduler.num_live)
        moves_seen += plan_moves_before != engine.scheduler.num_live
        it += 1
        assert it < 1000
    assert len(finals) == len(jobs)
    assert max(live_seen) == 4  # the buffer was full at some point
    for _, rid, prompt, params in jobs:
        assert finals[rid].token_ids == solo_tokens(model_dir, prompt, params, dtype, **options), rid
        assert len(finals[rid].token_ids) == params.max_new_tokens


def test_the_native_steps_sampler_draws_what_the_pytorch_sampler_draws(llama_dir, monkeypatch):
    """With the native step, sampled rows go through its C sampler (flover/native/sampling.c): on
    every iteration's logits (a random model: flat rows, the nucleus is most of the vocabulary)
    and every mix of filters, penalties and greedy rows, its ids are the PyTorch path's."""
    from flover.runner import runner as runner_module

    sample, compared, different = runner_module.sample, [], []

    def both(logits, st, native=None):  # (the runner catches what a sampler raises: nothing raised here)
        ids, logprobs = sample(logits, st, native)
        different.append(native is None or not torch.equal(ids, sample(logits, st)[0]))
        compared.append(len(ids) - int((st.temperature == 0).sum()))
        return ids, logprobs

    monkeypatch.setattr(runner_module, "sample", both)
    engine = Engine(EngineConfig(llama_dir, dtype="float32", max_slots=6, max_seq_len=96, speculate=0))
    rng = random.Random(3)
    for i in range(16):
        params = random_params(rng)
        if i % 4 == 0:
            params = SamplingParams(
                max_new_tokens=20,
                ignore_eos=True,
                temperature=0.8,
                top_p=0.95,
                top_k=40,
                repetition_penalty=1.1,
                seed=i,
            )
        engine.add_request([rng.randrange(1, 512) for _ in range(rng.randint(1, 30))], params, str(i))
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert sum(compared) > 100 and not any(different)  # sampled rows compared
    assert all(o.finish_reason == "length" for o in finals.values()) and len(finals) == 16


@pytest.mark.parametrize("native", ["off", "auto"])
def test_one_fused_forward_per_iteration(llama_dir, native):
    """Decode tokens of running requests and the prompt of a newly arrived request go through
    the model (PyTorch's forward, or the native step) in ONE call over one token matrix (every
    iteration decoding: prompt_first_iterations=0)."""
    engine = Engine(
        EngineConfig(
            llama_dir, dtype="float32", max_slots=4, max_seq_len=64, native_forward=native, prompt_first_iterations=0
        )
    )
    calls = []
    if native == "off":
        forward = engine.model.forward
        engine.model.forward = lambda batch, kv: calls.append(batch.input_ids.shape[0]) or forward(batch, kv)
    else:
        run = engine.runner.native.run
        engine.runner.native.run = lambda batch, **kw: calls.append(batch.input_ids.shape[0]) or run(batch, **kw)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.add_request([4, 5], SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.step()
    assert calls == [5]  # both prompts, one call
    engine.add_request([6, 7, 8, 9], SamplingParams(max_new_tokens=5, ignore_eos=True))
    outs = engine.step()  # 2 decode tokens + the 4-token prompt of the newcomer
    assert calls == [5, 6]
    assert {o.request_id for o in outs} == {"0", "1", "2"}  # the newcomer got its first token now


def test_prompts_first_defer_decoding_a_bounded_number_of_iterations_and_change_no_token(llama_dir):
    """prompt_first (3 iterations of at most 8 prompt tokens here): a newcomer's 40-token prompt
    runs alone for 3 iterations, then the running requests decode (with the rest of the prompt
    in the same call); every request's tokens are those of the same run decoding every iteration."""
    outputs = {}
    for iterations in (0, 3):
        engine = Engine(
            EngineConfig(
                llama_dir,
                dtype="float32",
                max_slots=4,
                max_seq_len=64,
                prompt_first_iterations=iterations,
                prompt_first_tokens=8,
            )
        )
        calls = []
        run = engine.runner.native.run
        engine.runner.native.run = lambda batch, **kw: calls.append(batch.input_ids.shape[0]) or run(batch, **kw)
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True), "a")
        engine.add_request([4, 5], SamplingParams(max_new_tokens=8, ignore_eos=True), "b")
        engine.step()
        engine.add_request(list(range(10, 50)), SamplingParams(max_new_tokens=4, ignore_eos=True), "long")
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        if iterations:
            assert calls[:6] == [5, 8, 8, 8, 2 + 16, 3]  # 3 prompt-only, then decode + the rest, then all decode
        else:
            assert calls[:2] == [5, 2 + 40]
        outputs[iterations] = finals
    assert outputs[3] == outputs[0] and len(outputs[0]) == 3


def test_finished_requests_return_at_once_and_free_their_slot(llama_dir):
    engine = Engine(EngineConfig(llama_dir, dtype="float32", max_slots=2, max_seq_len=64, prompt_first_iterations=0))
    engine.add_request([1, 2], SamplingParams(max_new_tokens=2, ignore_eos=True), "short")
    engine.add_request([3, 4], SamplingParams(max_new_tokens=6, ignore_eos=True), "long")
    engine.add_request([5, 6], SamplingParams(max_new_tokens=2, ignore_eos=True), "waiting")
    first = engine.step()
    assert {o.request_id for o in first} == {"short", "long"}
    second = engine.step()
    done = [o for o in second if o.finished]
    assert [o.request_id for o in done] == ["short"] and done[0].finish_reason == "length"
    third = engine.step()  # "short" left, "waiting" takes its slot in this very iteration
    assert {o.request_id for o in third} == {"long", "waiting"}
    assert engine.scheduler.requests["waiting"].slot in (0, 1)


def test_seeded_sampling_is_reproducible_across_batches(llama_dir):
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    llm = LLM(llama_dir, dtype="float32", max_slots=8, max_seq_len=64)
    alone = llm.generate([[7, 8, 9]], params)[0].token_ids
    crowd = llm.generate(
        [[1, 2]] * 3 + [[7, 8, 9]] + [[3]] * 3,
        [SamplingParams(max_new_tokens=9, temperature=1.2, ignore_eos=True)] * 3
        + [params]
        + [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 3,
    )
    assert crowd[3].token_ids == alone
    other = llm.generate([[7, 8, 9]], params.with_updates(seed=99))[0].token_ids
    assert other != alone


def test_stop_token_ids_and_eos(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    base = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0].token_ids
    stop_at = base[5]
    first = base.index(stop_at)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=30, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"
    # the same id declared as EOS stops too, unless ignore_eos
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=30, eos_token_ids=[stop_at]))[0]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=30, eos_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.token_ids == base and out.finish_reason == "length"


def test_stop_strings_end_generation_and_are_not_returned(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=128)
    full = llm.generate(["Hello the cat"], SamplingParams(max_new_tokens=60, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 10
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate(["Hello the cat"], SamplingParams(max_new_tokens=60, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_bad_requests_are_refused_and_change_nothing(llama_dir):
    engine = Engine(EngineConfig(llama_dir, dtype="float32", max_slots=2, max_seq_len=32))
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        engine.add_request(list(range(1, 30)), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 512\)"):
        engine.add_request([1, 512], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    engine.add_request([1, 2], SamplingParams(max_new_tokens=3), "x")
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request([1, 2], SamplingParams(), "x")
    assert list(engine.scheduler.requests) == ["x"] and engine.stats().waiting == 1
    llm = LLM(llama_dir, dtype="float32", max_seq_len=32)
    with pytest.raises(ValueError, match="prompt 1: .*exceeds max_seq_len"):
        llm.generate([[1], list(range(1, 40))])
    assert not llm.engine.scheduler.requests


def test_cancel_waiting_and_running_requests(llama_dir):
    engine = Engine(EngineConfig(llama_dir, dtype="float32", max_slots=1, max_seq_len=64))
    engine.add_request([1, 2], SamplingParams(max_new_tokens=50, ignore_eos=True), "run")
    engine.add_request([3, 4], SamplingParams(max_new_tokens=50, ignore_eos=True), "wait")
    engine.step()
    assert engine.abort("wait") and engine.abort("run")
    assert not engine.abort("run")  # already finished
    outs = engine.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {("run", "cancelled"), ("wait", "cancelled")}
    assert engine.scheduler.num_live == 0 and not engine.has_unfinished()


def test_logprobs_and_timings(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=True))[0]
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
    t = out.timings
    assert 0 <= t["queue_time"] <= t["ttft"] <= t["e2e"] and t["tpot"] > 0
    assert out.usage == {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0}


def test_threads_flag_and_kv_refusal(llama_dir):
    Engine(EngineConfig(llama_dir, num_threads=1, max_seq_len=32))
    assert torch.get_num_threads() == 1
    with pytest.raises(MemoryError, match="MiB"):
        Engine(EngineConfig(llama_dir, max_slots=10**6, max_batch_tokens=10**6, max_seq_len=512))
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Engine(EngineConfig(llama_dir, max_slots=8, max_batch_tokens=4))


def test_prompt_and_output_logprobs_equal_engine_score_whatever_the_batch(llama_dir):
    """`prompt_logprobs` (chunked prefills, fused with other requests arriving at random
    iterations) and the generated tokens' logprobs and top-k alternatives equal those of
    teacher-forced `Engine.score` of the whole sequence, in float64."""
    rng = random.Random(5)
    engine = Engine(EngineConfig(llama_dir, dtype="float64", max_slots=4, max_batch_tokens=16, max_seq_len=128))
    pending = []
    for n in range(10):
        prompt = [rng.randrange(512) for _ in range(rng.choice([1, 2, 7, 23, 40]))]
        asks = n % 3 != 2
        k = rng.choice([0, 1, 5]) if asks else 0
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 6),
            ignore_eos=True,
            prompt_logprobs=asks,
            logprobs=asks and n % 2 == 0,
            top_logprobs=k,
            temperature=rng.choice([0.0, 0.8]),
            seed=n,
        )
        pending.append((rng.randrange(8), prompt, params))
    finals, iteration = {}, 0
    while len(finals) < len(pending):
        for i, (arrives, prompt, params) in enumerate(pending):
            if arrives == iteration:
                engine.add_request(prompt, params, request_id=str(i))
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        iteration += 1
    for i, (_, prompt, params) in enumerate(pending):
        out = finals[str(i)]
        logp = torch.log_softmax(engine.score(prompt + out.token_ids), dim=-1)  # [len, vocab]
        if not params.prompt_logprobs:
            assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
        else:
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            want = [float(logp[p - 1, prompt[p]]) for p in range(1, len(prompt))]
            assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-9), i
            if params.top_logprobs:
                for p in range(1, len(prompt)):
                    top = logp[p - 1].topk(params.top_logprobs)
                    assert [t for t, _ in out.prompt_top_logprobs[p]] == top.indices.tolist()
                    assert [v for _, v in out.prompt_top_logprobs[p]] == pytest.approx(top.values.tolist(), abs=1e-9)
            else:
                assert out.prompt_top_logprobs is None
        if params.logprobs:
            rows = range(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
            want = [float(logp[r, t]) for r, t in zip(rows, out.token_ids)]
            assert out.logprobs == pytest.approx(want, abs=1e-9), i
            if params.top_logprobs:
                assert [[t for t, _ in top] for top in out.top_logprobs] == [
                    logp[r].topk(params.top_logprobs).indices.tolist() for r in rows
                ]
        else:
            assert out.logprobs is None and out.top_logprobs is None


def test_top_logprobs_need_a_logprobs_flag():
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)
    SamplingParams(prompt_logprobs=True, top_logprobs=20)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_cache_gives_exactly_the_tokens_without_it(llama_dir, seed):
    """Requests sharing random prefixes (and resending whole earlier sequences, as chat turns
    do) arrive at random iterations into a pool small enough to evict: greedy and seeded
    sampled tokens equal those of the same run without a prefix cache (float64)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(512) for _ in range(rng.randint(16, 70))] for _ in range(3)]
    jobs = []
    for n in range(16):
        prompt = rng.choice(stems) + [rng.randrange(512) for _ in range(rng.randint(0, 30))]
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 8),
            ignore_eos=True,
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(1000),
        )
        jobs.append((rng.randrange(12), prompt, params))

    def run(prefix_cache_mib: float):
        engine = Engine(
            EngineConfig(
                llama_dir,
                dtype="float64",
                max_slots=4,
                max_batch_tokens=32,
                max_seq_len=192,
                prefix_cache_mib=prefix_cache_mib,
            )
        )
        finals, iteration, turns = {}, 0, []
        while len(finals) < len(jobs) + len(turns) or iteration < 12:
            for i, (arrives, prompt, params) in enumerate(jobs):
                if arrives == iteration:
                    engine.add_request(prompt, params, request_id=str(i))
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    if out.request_id.isdigit() and int(out.request_id) % 3 == 0:  # a next turn: the sequence + more
                        turn = out.prompt_token_ids + out.token_ids + [7, 8, 9]
                        turns.append(turn)
                        engine.add_request(turn, SamplingParams(max_new_tokens=3), request_id=f"turn{out.request_id}")
            iteration += 1
        return finals, engine

    cached, engine = run(12 / 64)  # 12 blocks of this model's 16 KiB (float64)
    plain, _ = run(0)
    assert {k: v.token_ids for k, v in cached.items()} == {k: v.token_ids for k, v in plain.items()}
    assert all(o.cached_tokens == 0 for o in plain.values())
    stats = engine.prefix_cache.stats
    assert sum(o.cached_tokens for o in cached.values()) == stats.cached_tokens > 0
    assert stats.evicted_blocks > 0 and stats.hits < stats.lookups
    assert all(o.cached_tokens % 16 == 0 and o.cached_tokens < len(o.prompt_token_ids) for o in cached.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_padded_static_decode_batches_give_the_eager_tokens(llama_dir, seed):
    """The CUDA-graph path's static batches (rows and keys rounded up to buckets, padding rows
    writing a scratch slot), run without capture on CPU: the same tokens as plain iterations,
    with requests of every length arriving at random iterations (float64)."""
    static, engine = run_random_arrivals(llama_dir, seed, "eager")
    plain, plain_engine = run_random_arrivals(llama_dir, seed, "off")
    assert static == plain
    graphs = engine.runner.graphs
    assert plain_engine.runner.graphs is None and graphs.row_buckets == [1, 2, 4, 6]
    assert graphs.key_buckets == [64, 112]  # 110 rounded up to whole prefix-cache blocks
    assert graphs.replays > 0 and graphs.padding_rows > 0


def test_score_frees_the_slots_of_requests_that_just_finished(llama_dir):
    llm = LLM(llama_dir, dtype="float64", max_slots=2)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3))
    assert llm.engine.score([5, 6, 7]).shape[0] == 3


def test_max_new_tokens_none_means_the_rest_of_the_context(llama_dir):
    llm = LLM(llama_dir, dtype="float64", max_seq_len=40, max_slots=2)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 40 - 3 and out.finish_reason == "length"
