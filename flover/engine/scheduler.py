"""Iteration-level scheduling: which requests leave, which join, and which tokens one iteration
computes. Pure Python bookkeeping (no tensors), so it is unit-tested alone.

Order inside one `schedule()` call:
  1. retire finished/cancelled requests (their slots become holes); with a prefix cache, the
     KV blocks of their sequences, and of prompts completed since the last call, are saved;
  2. plan the compaction that closes the holes (kv_buffer.plan_compaction);
  3. every running request that finished its prompt decodes one token; except, with
     `prompt_first`, in up to that many iterations in a row while prompts wait, which then
     take up to `prompt_first_tokens` prompt tokens alone (see PromptFirst);
  4. prompts still being prefilled continue (FCFS), then waiting requests are admitted (FCFS)
     into the slots after the live range, while a slot is free and the token budget allows;
     an admitted prompt starts after its longest cached prefix (copied into its slot);
  5. with speculation, greedy decoding requests draft tokens in the budget left (speculation.py);
  6. with windowed KV, slots whose writes would pass their window's rows slide (kv_window.py).
The plan's copies run in this order: saves, the shuffle's moves, loads, slides (ModelRunner.execute).

With pipeline stages (`depth` > 1, engine/engine.py) up to `depth` plans are in flight at once,
each over requests no other holds (Orca's rule): a request in a plan not yet returned is
skipped, the decoding requests are shared out over the plans (at most 1/depth of them in one),
the shuffle copies the positions its plan in flight writes too, and a request cancelled while
in flight keeps its slot until its plan returns.

After the runner has carried a plan out, `update(plan, result)` takes its result: prompt chunks
become computed, embedding requests whose prompt is through end with their vector, sampled and
accepted draft tokens are appended up to a stop id or the length limit, and what drafts achieved
and what the iteration cost feed the next plans.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from flover.engine.prefix_cache import PrefixCache
from flover.engine.speculation import IterationCost, Speculation, drafts_for
from flover.request import FinishReason, NewTokens, Request, RequestState, StepResult
from flover.runner.kv_buffer import plan_compaction
from flover.runner.kv_window import WindowedKV
from flover.runner.plan import PrefillChunk, StateCopy, StepPlan


@dataclass(frozen=True)
class PromptFirst:
    """Prompts ahead of decoding, bounded: while prompts wait (chunks left, or requests waiting
    for a free slot), up to `iterations` iterations in a row run prompt tokens alone, at most
    `tokens` each; then one iteration decodes every running request again (with prompt chunks
    in the rest of its budget). Under bursts of arrivals this is what keeps time to first token
    down: a short prompt-only iteration ends sooner, so the requests that arrive during it
    (they wait for the next iteration boundary) wait less, and the decode rows deferred meanwhile
    run later in larger, cheaper batches (figures: docs/design_notes.md, "prompts first"). A
    running request waits at most `iterations` prompt-only iterations for its next
    token; iterations=0 decodes in every iteration. Decisions depend on scheduler state only, so
    tensor-parallel ranks, which each schedule, stay in step."""

    iterations: int = 3
    tokens: int = 192


class Scheduler:
    def __init__(
        self,
        max_slots: int,
        max_batch_tokens: int,
        prefix: PrefixCache | None = None,
        prompt_first: PromptFirst = PromptFirst(iterations=0),
        speculation: Speculation = Speculation(),
        window: WindowedKV | None = None,
        depth: int = 1,
        whole_prompts: bool = False,
        embed_share: float = 0.25,
    ):
        """`window`: the sliding-window layers' bounded rows (None: every layer keeps every position).
        `depth`: plans in flight at most (pipeline stages). `whole_prompts`: a prompt is never cut
        into chunks (an encoder's input attends both ways): it waits for an iteration with room.
        `embed_share`: beside decode rows, embedding inputs take rows worth at most this share of
        the iteration's time (by the fitted iteration cost), at least one: the decoding requests'
        time per token grows by about it (they are background work; with no decode rows they
        take the whole budget)."""
        if max_batch_tokens < max_slots:
            raise ValueError("max_batch_tokens must be >= max_slots")
        self.max_slots = max_slots
        self.max_batch_tokens = max_batch_tokens
        self.prefix = prefix
        self.prompt_first = prompt_first
        self.speculation = speculation
        self.window = window
        self.depth = depth
        self.whole_prompts = whole_prompts
        self.embed_share = embed_share
        self._embed_room = 0  # embedding rows this iteration may still take
        self.iteration_cost = IterationCost()  # the engine reports each iteration's rows and time
        self._prompt_only = 0  # prompt-only iterations in a row so far
        self.requests: dict[str, Request] = {}  # every request from add() until it leaves (all below)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_slots
        self.num_live = 0  # slots [0, num_live) may hold requests; all above are free
        self._prefilling: list[Request] = []  # admitted, prompt not complete, FCFS order

    # -- intake ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        request.state = RequestState.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def cancel(self, request_id: str, now: float) -> Request | None:
        """Finish a request now (None if unknown or already finished). A waiting one leaves at
        once; a running one keeps its slot until the next retire step."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
            del self.requests[request_id]
        request.finish(FinishReason.CANCELLED, now)
        return request

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots[: self.num_live] if r is not None and not r.finished]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots[: self.num_live])

    # -- one iteration --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = self.release()

        # 3. decode: one token for every live request whose prompt is complete (unless prompts go first).
        plan.decode = [r for r in self.slots[: self.num_live] if not r.prefilling and not r.in_flight]
        if self.depth > 1:  # each plan in flight takes its share of the decoding requests
            decoding = sum(1 for r in self.slots[: self.num_live] if not r.prefilling)
            plan.decode = plan.decode[: -(-decoding // self.depth)]
        budget = self.max_batch_tokens - len(plan.decode)
        # (embedding inputs are background: they never defer decode rows for prompts first; beside
        # decoding requests, decoding now or deferred, they take their share of rows: _embed_rows)
        prompts_wait = any(r.embed is None for r in self._prefilling) or (
            self.num_live < self.max_slots and any(r.embed is None for r in self.waiting)
        )
        if plan.decode and prompts_wait and self._prompt_only < self.prompt_first.iterations:
            plan.decode = []
            budget = min(self.max_batch_tokens, self.prompt_first.tokens)
            self._prompt_only += 1
        else:
            self._prompt_only = 0

        self._embed_room = self._embed_rows(sum(1 for r in self.slots[: self.num_live] if r and not r.prefilling))
        # 4a. continue chunked prompts, oldest first.
        for request in self._prefilling:
            if budget == 0:
                break
            if not request.in_flight:
                budget -= self._add_chunk(plan, request, budget)

        # 4b. admit waiting requests FCFS into the slots after the live range.
        budget = self._admit(plan, budget)
        if self.prefix is not None and self.prefix.disk is not None:
            plan.pool_fills, plan.state_fills = self.prefix.take_fills()

        # 5. drafts, in what budget prompts left, of tokens likely enough to be accepted to pay
        #    for their rows in an iteration of this size (speculation.py).
        if self.speculation.tokens and plan.decode and budget > 0:
            min_acceptance = len(plan.decode) / (self.iteration_cost.knee + plan.num_tokens)
            plan.drafts = drafts_for(plan.decode, self.speculation, budget, min_acceptance)
        if self.prefix is not None and self.prefix.recurrent and not plan.drafts:
            self._decode_snapshots(plan)
        if self.window is not None:
            self._slide_windows(plan)
        plan.num_live = self.num_live
        if self.depth > 1:
            _mark_in_flight(plan)
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> int:
        """Step 4b: waiting requests into the slots after the live range, each after its longest
        cached prefix, while a slot is free and the budget allows; the budget left."""
        now = time.perf_counter()
        deferred = []  # embedding inputs past this iteration's room for them: first in line again after
        while self.waiting and budget > 0 and self.num_live < self.max_slots:
            if self.whole_prompts and self.waiting[0].prompt_len > budget:
                break  # (FCFS: it goes first in a later iteration; the engine keeps any input within one's budget)
            if self.waiting[0].embed is not None and self._embed_room == 0:
                deferred.append(self.waiting.popleft())
                continue
            request = self.waiting.popleft()
            request.state = RequestState.RUNNING
            request.timings.scheduled = now
            request.slot = self.num_live
            self.slots[self.num_live] = request
            self.num_live += 1
            plan.admitted.append(request)
            if request.embed is not None:  # pooled rows are computed ones; its KV is no one's prefix
                request.prompt_saved = True
            elif self.prefix is not None and not request.params.prompt_logprobs:  # scoring needs every prompt row
                loads = self.prefix.lookup(
                    request.prompt_token_ids, request.prompt_len - 1, request.slot, request.cache_salt
                )
                request.num_computed = request.cached_tokens = len(loads) * self.prefix.block_tokens
                plan.loads += loads
                if self.prefix.recurrent and loads:  # (the recurrent layers' state after those blocks)
                    plan.state_loads.append(StateCopy(request.slot, self.prefix.snapshot_after(loads)))
            request.window_base = self.window.base_for(request.num_computed) if self.window else 0
            self._prefilling.append(request)
            budget -= self._add_chunk(plan, request, budget)
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _embed_rows(self, decode_rows: int) -> int:
        """The rows embedding inputs may take this iteration: beside `decode_rows` decoding requests,
        those that cost `embed_share` of a decode iteration (a + b rows: share x (knee + decode
        rows)), at least one; without any, all of them."""
        if not decode_rows:
            return self.max_batch_tokens
        return max(1, int(self.embed_share * (self.iteration_cost.knee + decode_rows)))

    def _decode_snapshots(self, plan: StepPlan) -> None:
        """Recurrent layers: a decoding request whose next token completes a block has its state
        after it kept (one row a request, overwritten at each later block edge), so that the
        sequence's blocks, stored when it leaves, end in a snapshot."""
        t = self.prefix.block_tokens
        for i, r in enumerate(plan.decode):
            if (r.kv_len + 1) % t or r.params.prompt_logprobs:
                continue
            row = r.decode_snapshot[1] if r.decode_snapshot is not None else self.prefix.reserve_snapshot()
            if row is not None:
                r.decode_snapshot = (r.kv_len + 1, row)
                plan.decode_snapshots[i] = row

    def _slide_windows(self, plan: StepPlan) -> None:
        """Step 6: each slot that writes past its windowed rows slides first (drafts longer than a
        slot's room per iteration are cut; at most one shift a slot, as it has one write range)."""
        room = self.window.chunk
        plan.drafts = [draft[: room - 1] for draft in plan.drafts]
        writes = [
            (r, r.kv_len, r.kv_len + 1 + (len(plan.drafts[i]) if plan.drafts else 0)) for i, r in enumerate(plan.decode)
        ]
        writes += [(c.request, c.start, c.start + c.length) for c in plan.prefill]
        for request, start, end in writes:
            shift = self.window.shift(request.slot, request.window_base, start, end)
            if shift is not None:
                plan.shifts.append(shift)
                request.window_base = shift.base

    def release(self) -> StepPlan:
        """Steps 1-2 alone: retire finished requests and compact, scheduling no tokens (frees
        the slots of requests that finished in the last iteration before the next one runs)."""
        plan = StepPlan()
        self._retire(plan)
        if self.prefix is not None:
            self._save_prefixes(plan)
        self._compact(plan)
        plan.num_live = self.num_live
        return plan

    def _retire(self, plan: StepPlan) -> None:
        """Finished requests leave their slots; except one that a plan in flight still holds (a
        pipeline's request cancelled meanwhile): its slot stays its own until that plan returns,
        so a plan's rows never index a freed or reused slot (its token is then dropped by update)."""
        for slot in range(self.num_live):
            request = self.slots[slot]
            if request is not None and request.finished and not request.in_flight:
                if self.prefix is not None and request.embed is None:  # the whole sequence whose KV the slot holds
                    tokens = request.prompt_token_ids + request.output_token_ids
                    plan.saves += self.prefix.store(
                        tokens, request.kv_len, slot, request.cache_salt, request.window_base
                    )
                    self._attach_snapshots(request, tokens, request.kv_len)
                self.slots[slot] = None
                request.slot = None
                plan.retired.append(request)
                self.requests.pop(request.request_id, None)
        if plan.retired:
            gone = {id(r) for r in plan.retired}
            self._prefilling = [r for r in self._prefilling if id(r) not in gone]

    def _save_prefixes(self, plan: StepPlan) -> None:
        """Prompts completed since the last plan are saved now rather than when their requests
        leave: concurrent requests that share a system prompt reuse it at once."""
        for request in self.slots[: self.num_live]:
            if request is not None and not request.prefilling and not request.prompt_saved:
                request.prompt_saved = True
                plan.saves += self.prefix.store(
                    request.prompt_token_ids, request.prompt_len, request.slot, request.cache_salt, request.window_base
                )
                self._attach_snapshots(request, request.prompt_token_ids, request.prompt_len)

    def _attach_snapshots(self, request: Request, tokens: list[int], stored: int) -> None:
        """The request's states taken at block edges within the `stored` positions just stored
        become their blocks' snapshots (a request leaving releases the rest)."""
        for name in ("prompt_snapshot", "decode_snapshot"):
            taken = getattr(request, name)
            if taken is None:
                continue
            end, row = taken
            if end <= stored:
                self.prefix.attach_snapshot(tokens, end, request.cache_salt, row)
                setattr(request, name, None)
            elif request.finished:
                self.prefix.release_snapshot(row)
                setattr(request, name, None)

    def _compact(self, plan: StepPlan) -> None:
        occupied = [r is not None for r in self.slots[: self.num_live]]
        plan.moves = plan_compaction(occupied)
        for move in plan.moves:
            request = self.slots[move.src]
            self.slots[move.dst], self.slots[move.src] = request, None
            request.slot = move.dst
            plan.moved_kv_len = max(plan.moved_kv_len, request.kv_len + request.in_flight)
        self.num_live = sum(occupied)

    def _add_chunk(self, plan: StepPlan, request: Request, budget: int) -> int:
        if self.window is not None:  # a slot's windowed rows take at most `chunk` new positions at once
            budget = min(budget, self.window.chunk)
        if request.embed is not None:  # (its share beside decode rows)
            budget = min(budget, self._embed_room)
            if budget == 0:
                return 0
            self._embed_room -= min(budget, request.prompt_len - request.num_computed)
        start = request.num_computed
        length = min(request.prompt_len - start, budget)
        edge = self._prompt_snapshot_edge(request)
        if edge is not None and start < edge <= start + length:
            row = self.prefix.reserve_snapshot()
            if row is not None:  # two chunks in this iteration: the recurrent layers' state between them is kept
                request.prompt_snapshot = (edge, row)
                plan.prefill.append(PrefillChunk(request, start, edge - start, snapshot=row))
                if start + length > edge:
                    plan.prefill.append(PrefillChunk(request, edge, start + length - edge))
                return length
        plan.prefill.append(PrefillChunk(request, start, length))
        return length

    def _prompt_snapshot_edge(self, request: Request) -> int | None:
        """Recurrent layers: the last block edge before the prompt's last token, where a later
        prompt that extends this one (the next turn of a conversation) can start; None where no
        snapshot is wanted."""
        if self.prefix is None or not self.prefix.recurrent or request.params.prompt_logprobs or request.embed:
            return None
        if request.prompt_snapshot is not None:
            return None
        t = self.prefix.block_tokens
        edge = (request.prompt_len - 1) // t * t
        return edge if edge > request.cached_tokens else None

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[NewTokens]:
        """The runner carried `plan` out: the chunks' K/V are in the cache, and each sampled
        request gets its token and those its accepted draft adds, checked one by one: a stop id
        or the length limit makes its token the last. A request whose sampling failed ends with
        finish reason `error`. Returns what each sampled request got."""
        for chunk in plan.prefill:
            chunk.request.num_computed += chunk.length
            chunk.request.in_flight = 0
        for r in plan.decode:
            r.in_flight = 0
        self._prefilling = [r for r in self._prefilling if r.prefilling]
        _record_prompt_logprobs(result)
        updates = []
        for r, vector in result.embeddings:  # an embedding request ends with its prompt
            if not r.finished:
                r.embedding = vector
                r.timings.first_token = now
                r.finish(FinishReason.STOP, now)
                updates.append(NewTokens(r, []))
        for i, (r, token) in enumerate(zip(result.sampled, result.token_ids)):
            if r.finished:  # (pipeline stages: cancelled while its plan was in flight)
                continue
            if i in result.failed:
                why = result.failed[i]
                r.finish(FinishReason.ERROR, now, error=why, code=getattr(why, "code", None))
                updates.append(NewTokens(r, []))
                continue
            if result.logprobs is not None and result.logprobs[i] is not None and r.params.logprobs:
                logprob, alternatives = result.logprobs[i]  # one token: drafts are for requests without logprobs
                r.output_logprobs.append(logprob)
                if r.params.top_logprobs:
                    r.output_top_logprobs.append(alternatives[: r.params.top_logprobs])
            if r.timings.first_token is None:
                r.timings.first_token = now
            updates.append(NewTokens(r, _append_tokens(r, [token, *result.accepted.get(i, ())], now)))
        for i, r in enumerate(plan.decode if plan.drafts else ()):  # what drafting achieved, for the next drafts
            if r.drafting is not None:
                r.drafting.learn(len(plan.drafts[i]), len(result.accepted.get(i, ())))
        if result.rows:
            self.iteration_cost.observe(result.rows, result.seconds)
        return updates


def _mark_in_flight(plan: StepPlan) -> None:
    """Pipeline stages: the positions the plan writes for each of its requests."""
    for i, r in enumerate(plan.decode):
        r.in_flight = 1 + (len(plan.drafts[i]) if plan.drafts else 0)
    for chunk in plan.prefill:
        chunk.request.in_flight = 0
    for chunk in plan.prefill:  # (a prompt may have two chunks: before and after a snapshot)
        chunk.request.in_flight += chunk.length


def _append_tokens(r: Request, tokens: list[int], now: float) -> list[int]:
    """`tokens` appended to r's output one by one, each checked: a broken grammar, a stop id, a
    finished grammar or the length limit ends the request at that token. Those appended."""
    for n, t in enumerate(tokens, 1):
        r.output_token_ids.append(t)
        broke = r.grammar.advance(t) if r.grammar is not None else None
        if broke is not None:
            r.finish(FinishReason.ERROR, now, error=broke)
        elif t in r.stop_token_set or (r.grammar is not None and r.grammar.done):
            r.finish(FinishReason.STOP, now)
        elif len(r.output_token_ids) >= r.params.max_new_tokens:
            r.finish(FinishReason.LENGTH, now)
        if r.finished:
            return tokens[:n]
    return tokens


def _record_prompt_logprobs(result: StepResult) -> None:
    """Each scored prefill chunk's prompt logprobs, appended in prompt order (chunks of one
    prompt come in order, one per iteration)."""
    for rows, entries in zip(result.scoring, result.prompt_logprobs):
        r, k = rows.request, rows.request.params.top_logprobs
        if not r.prompt_logprobs:
            r.prompt_logprobs.append(None)  # the first token has no context to be predicted from
            r.prompt_top_logprobs.append(None)
        for logprob, alternatives in entries:
            r.prompt_logprobs.append(logprob)
            r.prompt_top_logprobs.append(alternatives[:k])
