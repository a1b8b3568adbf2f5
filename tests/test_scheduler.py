"""Admission, token budget, chunked prefill, retirement and compaction, with no tensors."""

from __future__ import annotations

import random

import pytest

from flover.config import SamplingParams
from flover.engine.scheduler import PromptFirst, Scheduler
from flover.request import FinishReason, Request, StepResult


def req(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams())


def run_plan(s: Scheduler):
    plan = s.schedule()
    # a request whose prompt completed has sampled its first token
    sampled = plan.decode + [c.request for c in plan.prefill if c.completes_prompt]
    s.update(plan, StepResult(sampled=sampled, token_ids=[0] * len(sampled), rows=plan.num_tokens), now=0.0)
    return plan


def test_fcfs_admission_limited_by_slots():
    s = Scheduler(max_slots=2, max_batch_tokens=100)
    for i in range(3):
        s.add(req(str(i), 3))
    plan = run_plan(s)
    assert [c.request.request_id for c in plan.prefill] == ["0", "1"]
    assert [r.slot for r in s.slots if r] == [0, 1]
    assert [r.request_id for r in s.waiting] == ["2"]
    plan = run_plan(s)
    assert [r.request_id for r in plan.decode] == ["0", "1"] and not plan.prefill


def test_long_prompt_is_chunked_and_running_requests_keep_decoding():
    s = Scheduler(max_slots=4, max_batch_tokens=8)
    s.add(req("short", 2))
    run_plan(s)
    s.add(req("long", 20))
    seen = []
    while s.slots[1] is None or s.slots[1].prefilling:
        plan = run_plan(s)
        assert plan.num_tokens <= 8
        assert [r.request_id for r in plan.decode] == ["short"]  # never stalled
        seen += [(c.start, c.length) for c in plan.prefill]
    assert seen == [(0, 7), (7, 7), (14, 6)]


def test_new_requests_wait_behind_a_chunked_prompt_only_for_budget():
    s = Scheduler(max_slots=4, max_batch_tokens=8)
    s.add(req("long", 10))
    s.add(req("next", 3))
    plan = run_plan(s)
    assert [(c.request.request_id, c.length) for c in plan.prefill] == [("long", 8)]
    plan = run_plan(s)  # long finishes its prompt (2 tokens), next is admitted with the rest
    assert [(c.request.request_id, c.start, c.length) for c in plan.prefill] == [("long", 8, 2), ("next", 0, 3)]


def test_finished_requests_leave_and_holes_are_compacted():
    s = Scheduler(max_slots=4, max_batch_tokens=16)
    reqs = [req(str(i), 2) for i in range(4)]
    for r in reqs:
        s.add(r)
    run_plan(s)
    reqs[0].finish(FinishReason.STOP, 0.0)
    reqs[2].finish(FinishReason.LENGTH, 0.0)
    plan = run_plan(s)
    assert {r.request_id for r in plan.retired} == {"0", "2"}
    assert [(m.src, m.dst) for m in plan.moves] == [(3, 0)]
    assert s.num_live == 2 and [r.request_id for r in s.slots[:2]] == ["3", "1"]
    assert [r.slot for r in plan.decode] == [0, 1]


def test_cancel_waiting_and_running():
    s = Scheduler(max_slots=1, max_batch_tokens=8)
    a, b = req("a", 2), req("b", 2)
    s.add(a)
    s.add(b)
    run_plan(s)
    assert s.cancel("b", 1.0) is b
    assert not s.waiting and b.finish_reason is FinishReason.CANCELLED
    assert s.cancel("a", 1.0) is a and s.cancel("a", 1.0) is None
    plan = run_plan(s)
    assert plan.retired == [a] and plan.empty and not s.has_work()


def test_prompts_go_first_for_at_most_the_given_iterations_then_running_requests_decode():
    """PromptFirst(2, 4): while a long prompt is prefilled, two iterations in a row run 4 of its
    tokens alone, then one decodes the running request (with a chunk in the rest of the budget);
    once no prompt waits, every iteration decodes."""
    s = Scheduler(max_slots=4, max_batch_tokens=8, prompt_first=PromptFirst(iterations=2, tokens=4))
    s.add(req("short", 2))
    run_plan(s)
    s.add(req("long", 30))
    seen = []
    while s.slots[1] is None or s.slots[1].prefilling:
        plan = run_plan(s)
        seen.append(([r.request_id for r in plan.decode], [c.length for c in plan.prefill]))
    assert seen == [([], [4]), ([], [4]), (["short"], [7]), ([], [4]), ([], [4]), (["short"], [7])]
    assert [r.request_id for r in run_plan(s).decode] == ["short", "long"]
    # a full house: requests waiting for a slot are no prompt work, running requests decode
    full = Scheduler(max_slots=1, max_batch_tokens=8, prompt_first=PromptFirst(iterations=3, tokens=4))
    full.add(req("a", 2))
    run_plan(full)
    full.add(req("b", 2))
    assert [[r.request_id for r in run_plan(full).decode] for _ in range(3)] == [["a"]] * 3


@pytest.mark.parametrize("seed", range(30))
def test_random_workload_invariants(seed):
    rng = random.Random(seed)
    first = PromptFirst(iterations=rng.choice([0, 1, 3]), tokens=rng.randint(1, 10))
    s = Scheduler(max_slots=rng.randint(1, 6), max_batch_tokens=rng.randint(6, 20), prompt_first=first)
    pending = [req(str(i), rng.randint(1, 25)) for i in range(20)]
    done = set()
    without_decode = 0  # iterations in a row that decoded none of the requests able to
    for _ in range(400):
        if pending and rng.random() < 0.4:
            s.add(pending.pop(0))
        for r in s.running:
            if not r.prefilling and rng.random() < 0.2:
                r.finish(FinishReason.STOP, 0.0)
        decodable = [r for r in s.running if not r.prefilling]
        plan = run_plan(s)
        done |= {r.request_id for r in plan.retired}
        if plan.decode or not [r for r in decodable if r.slot is not None]:
            without_decode = 0
        else:
            without_decode += 1
            assert without_decode <= first.iterations  # running requests wait a bounded number of iterations
            assert plan.num_tokens <= first.tokens
        live = s.slots[: s.num_live]
        assert all(r is not None for r in live)  # live range is contiguous
        assert all(r is None for r in s.slots[s.num_live :])
        assert all(r.slot == i for i, r in enumerate(live))
        assert plan.num_tokens <= s.max_batch_tokens
        assert [r.slot for r in plan.decode] == sorted(r.slot for r in plan.decode)
        if not pending and not s.has_work():
            break
    assert done == {str(i) for i in range(20)}
