"""Admission, token budget, chunked prefill, retirement and compaction, with no tensors."""

from __future__ import annotations

import random

import pytest

from flover.config import SamplingParams
from flover.request import FinishReason, Request
from flover.scheduler import Scheduler


def req(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams())


def run_plan(s: Scheduler):
    plan = s.schedule()
    s.commit(plan)
    # a request whose prompt completed has sampled its first token
    for r in plan.decode + [c.request for c in plan.prefill if c.completes_prompt]:
        r.output_token_ids.append(0)
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
    s.cancel(b, 1.0)
    assert not s.waiting and b.finish_reason is FinishReason.CANCELLED
    s.cancel(a, 1.0)
    plan = run_plan(s)
    assert plan.retired == [a] and plan.empty and not s.has_work()


@pytest.mark.parametrize("seed", range(30))
def test_random_workload_invariants(seed):
    rng = random.Random(seed)
    s = Scheduler(max_slots=rng.randint(1, 6), max_batch_tokens=rng.randint(6, 20))
    pending = [req(str(i), rng.randint(1, 25)) for i in range(20)]
    done = set()
    for _ in range(400):
        if pending and rng.random() < 0.4:
            s.add(pending.pop(0))
        for r in s.running:
            if not r.prefilling and rng.random() < 0.2:
                r.finish(FinishReason.STOP, 0.0)
        plan = run_plan(s)
        done |= {r.request_id for r in plan.retired}
        live = s.slots[: s.num_live]
        assert all(r is not None for r in live)  # live range is contiguous
        assert all(r is None for r in s.slots[s.num_live:])
        assert all(r.slot == i for i, r in enumerate(live))
        assert plan.num_tokens <= s.max_batch_tokens
        assert [r.slot for r in plan.decode] == sorted(r.slot for r in plan.decode)
        if not pending and not s.has_work():
            break
    assert done == {str(i) for i in range(20)}
