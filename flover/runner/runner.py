"""The tensor half of the engine: it carries out a step plan (`execute`) and hands back a
StepResult. In one place and in the order the copies need: prefix saves -> the shuffle's moves ->
prefix loads and the admitted requests' sampling state -> the iteration's token matrix (from the
requests themselves) -> the one fused forward -> sampling and draft verification (with the
tensor-parallel gather and broadcast). It never looks at text.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from flover.models.attention import ForwardBatch, PrefillSpan
from flover.models.pooling import Pooling, pooled_rows
from flover.native.forward import NativeForward
from flover.parallel.comm import Communicator
from flover.request import Logprob, PromptRows, Request, StepResult
from flover.runner.cuda_graphs import DecodeGraphs
from flover.runner.kv_buffer import SlotBuffer
from flover.runner.plan import PrefillChunk, StepPlan
from flover.runner.pooling import DenseStack, PooledRows
from flover.runner.sampler import SamplingTensors, greedy, sample, token_logprobs
from flover.structured.grammars import allowed_bits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolRows:
    """An embedding request's rows among the forward's pooled rows (batch.pool_rows)."""

    request: Request
    first: int  # index of its first row in the pooled rows
    count: int  # (0: a chunk with none of the rows its pooling keeps)
    completes: bool  # its prompt's last chunk: the vector is made


@dataclass
class IterationRows:
    """Which rows of the forward's logits are for what: first the sampled requests' rows (one
    each, and after a decoding request's own row one per token of its draft), then the
    prompt-scoring rows; and which pooled rows are whose."""

    sampled: list[Request]
    scoring: list[PromptRows] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # of the first len(drafts) sampled requests
    pooling: list[PoolRows] = field(default_factory=list)
    ranked: list[Request] = field(default_factory=list)  # decoder rerankers' pairs: their last rows' logits last

    def request_drafts(self) -> list[list[int]]:
        """Each sampled request's draft (empty where it has none)."""
        return [self.drafts[i] if i < len(self.drafts) else [] for i in range(len(self.sampled))]

    def owners(self) -> list[int]:
        """The index (in `sampled`) of each sampled row's request."""
        return [i for i, draft in enumerate(self.request_drafts()) for _ in range(1 + len(draft))]

    def per_row(self) -> list[Request]:
        """The request of each sampled row."""
        return [self.sampled[i] for i in self.owners()] if self.drafts else self.sampled


def plain_greedy(requests: list[Request]) -> bool:
    return all(r.params.plain_greedy for r in requests)


class PyTorchForward:
    """The model's own forward: runs every iteration the faster backends decline."""

    def __init__(self, model: torch.nn.Module, buffer: SlotBuffer):
        self.model, self.buffer = model, buffer

    def run(self, batch: ForwardBatch, greedy: bool = False) -> torch.Tensor:
        if batch.draft_rows:  # the scheduler keeps speculative iterations within the native step's rows
            raise RuntimeError("an iteration with speculative draft rows needs the native step")
        if batch.pool_rows is None:
            return self.model(batch, self.buffer.layers)
        model = self.model  # (embeddings: the forward in its parts, to keep the pooled rows too)
        hidden = model.run_layers(model.embed_tokens(batch), batch, self.buffer.layers)  # [T, hidden]
        batch.pooled = model.final_norm(hidden[batch.pool_rows])
        return model.head(hidden[batch.sample_rows])


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        buffer: SlotBuffer,
        vocab_size: int,
        device: torch.device,
        comm: Communicator | None,
        seed: int,
        graphs: DecodeGraphs | None = None,
        native: NativeForward | None = None,
    ):
        """`comm`: the tensor-parallel communicator of several ranks (rank 0 samples), or None.
        `graphs`: decode-only iterations replayed from CUDA graphs (others run eagerly).
        `native`: iterations as one native call (CPU; it declines some, which run on PyTorch)."""
        self.model, self.buffer, self.vocab_size, self.device, self.comm = model, buffer, vocab_size, device, comm
        self.graphs, self.native = graphs, native
        # The forwards, fastest first; each but PyTorch's may decline an iteration (None).
        self.backends = [b for b in (graphs, native) if b is not None] + [PyTorchForward(model, buffer)]
        self.is_leader = comm is None or comm.rank == 0
        self.broadcasts_ids = True  # the followers' schedulers take the sampled ids (not under --pp)
        self.pooling: Pooling | None = None  # how embedding requests pool (the engine sets it)
        self.dense: DenseStack | None = None  # and the Dense modules after the pooling, if any
        self._rng = random.Random(seed)  # seeds requests that bring none
        state = buffer.add_state  # per-slot sampling parameters (a request's lengths and tokens are its own)
        self._temperature = state("temperature", torch.float32)
        self._top_k = state("top_k", torch.int64)
        self._top_p = state("top_p", torch.float32, 1.0)
        self._min_p = state("min_p", torch.float32)
        self._rep_penalty = state("repetition_penalty", torch.float32, 1.0)
        self._frequency_penalty = state("frequency_penalty", torch.float32)
        self._presence_penalty = state("presence_penalty", torch.float32)
        self._seed = state("seed", torch.int64)

    def execute(self, plan: StepPlan) -> StepResult:
        """Carry out one plan, copies first: blocks of finished sequences and completed prompts go
        to the prefix pool before the shuffle's moves overwrite their slots, and cached prefixes
        come into the admitted requests' slots after them."""
        if plan.saves:
            self.buffer.save_blocks(plan.saves)
        if plan.moves:  # limited to the cached positions of the moved slots
            self.buffer.apply_moves(plan.moves, positions=max(1, plan.moved_kv_len))
        if plan.empty:
            return StepResult()
        self.admit(plan)
        if plan.shifts:  # after the loads: a slot admitted with a cached prefix may slide at once
            self.buffer.apply_shifts(plan.shifts)
        started = time.perf_counter()
        batch, rows = self.build_batch(plan)
        logits = self.forward(batch, rows)  # [B, vocab] (or greedy ids): the one fused forward
        result = self.sample(logits, rows)  # with drafts: the tokens each one's accepted part gives
        result.embeddings += self.pool(batch.pooled, rows.pooling)  # (after any decoder reranker's scores)
        result.rows, result.draft_rows = batch.input_ids.shape[0], batch.draft_rows
        result.seconds = time.perf_counter() - started
        return result

    def forward(self, batch: ForwardBatch, rows: IterationRows | None = None) -> torch.Tensor | list[int]:
        """[B, vocab] logits of the sampled rows (this rank's vocabulary block under TP); or,
        given the iteration's `rows` and all of them plain greedy, maybe their ids already (the
        native step's screened head): sample() takes either."""
        greedy = rows is not None and not rows.scoring and not rows.ranked and plain_greedy(rows.sampled)
        for backend in self.backends:
            out = backend.run(batch, greedy=greedy)
            if out is not None:
                return out
        raise AssertionError("PyTorch's forward runs every iteration")

    def pool(self, pooled: torch.Tensor | None, pooling: list[PoolRows]) -> list[tuple[Request, list[float]]]:
        """pooled [P, hidden]: the iteration's pooled rows -> each request whose prompt is through,
        with its vector. A request's rows are reduced on it as they come (PooledRows), the same
        whatever its chunks were."""
        done = []
        for p in pooling:
            r = p.request
            if r.pooled is None:
                r.pooled = PooledRows(self.pooling)
            if p.count:
                r.pooled.add(pooled[p.first : p.first + p.count])
            if p.completes:
                done.append((r, self._vector(r).tolist()))
                r.pooled = None
        return done

    def _vector(self, r: Request) -> torch.Tensor:
        """A request's vector; a cross-encoder's: its label scores from its pooled first row."""
        if not self.pooling.classify:
            return r.pooled.vector(r.embed.dimensions, self.dense)
        if self.dense is not None:  # (a reranker GGUF file's head: llama.cpp's cls, cls.output)
            return self._activated(self.dense(r.pooled.vector()))
        return self._activated(self.model.classify(r.pooled.vector()))  # [num_labels]

    def _activated(self, scores: torch.Tensor) -> torch.Tensor:
        if self.pooling.activation == "softmax":  # (two labels: the first one's share)
            return torch.sigmoid(scores[..., :1].double() - scores[..., 1:].double())
        return torch.sigmoid(scores) if self.pooling.activation == "sigmoid" else scores

    def _ranked(self, logits: torch.Tensor, ranked: list[Request]) -> list[tuple[Request, list[float]]]:
        """A decoder reranker's pairs: logits [pairs, vocab] of their last rows -> each one's score,
        the true token's logit minus the false one's (float64), activated."""
        true, false = self.pooling.logit_tokens
        scores = logits[:, true].double() - (logits[:, false].double() if false is not None else 0.0)
        return [(r, [value]) for r, value in zip(ranked, self._activated(scores).tolist())]

    def expert_load(self) -> list[dict] | None:
        """A mixture of experts: per layer of experts, the rows routed to each expert so far (both
        the PyTorch and the native forward count into the same tensor); None for other models."""
        layers = getattr(self.model, "layers", ())
        stage = getattr(self.model, "stage", None)  # (pipeline stages: the model's own layer numbers)
        numbers = stage.layers if stage is not None else range(len(layers))
        loads = [
            {"layer": n, "rows": layer.experts.load.tolist()}
            for n, layer in zip(numbers, layers)
            if getattr(layer, "experts", None) is not None
        ]
        return loads or None

    def admit(self, plan: StepPlan) -> None:
        """Write the per-slot state of requests that got a slot in this plan, and copy their
        cached prefixes into their slots (those read from disk into the pool first)."""
        if plan.pool_fills:
            self.buffer.fill_blocks(plan.pool_fills)
        self.buffer.load_blocks(plan.loads)
        if plan.state_fills:
            self.buffer.fill_snapshots(plan.state_fills)
        if plan.state_loads:
            self.buffer.load_states(plan.state_loads)
        for request in plan.admitted:
            if self.buffer.window_base is not None:
                self.buffer.window_base[request.slot] = request.window_base
            self.sampling_state(request)

    def sampling_state(self, request: Request) -> None:
        """An admitted request's sampling parameters into its slot's state."""
        slot, params = request.slot, request.params
        self._temperature[slot] = params.temperature
        self._top_k[slot] = params.top_k
        self._top_p[slot] = params.top_p
        self._min_p[slot] = params.min_p
        self._rep_penalty[slot] = params.repetition_penalty
        self._frequency_penalty[slot] = params.frequency_penalty
        self._presence_penalty[slot] = params.presence_penalty
        self._seed[slot] = params.seed if params.seed is not None else self._rng.getrandbits(63)

    def build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, IterationRows]:
        """The iteration's token matrix: decode tokens in slot order, then the prefill chunks.
        Built from the requests (a decode row's input is its last sampled token, at position
        kv_len) as lists, then one tensor per field: after a native forward every first tensor
        operation pays cache misses, so as few kinds as possible."""
        decode = plan.decode
        span = decode[-1].slot + 1 if decode else 0  # decode rows lie in slots [0, span)
        span_lens = [1] * span  # the slots in the span that are prefilling attend to nothing here
        ids, positions, slots = [], [], []
        for r, draft in zip(decode, plan.drafts or [()] * len(decode)):  # its row, then its draft's after it
            ids += [r.output_token_ids[-1], *draft]
            positions += range(r.kv_len, r.kv_len + 1 + len(draft))
            slots += [r.slot] * (1 + len(draft))
            span_lens[r.slot] = r.kv_len + 1
        num_decode = len(ids)
        draft_rows = num_decode - len(decode)

        prefills, sample_rows, score_rows, ranked_rows, pool_rows, types = [], list(range(num_decode)), [], [], [], []
        snapshots = dict(plan.decode_snapshots)  # (no drafts then: decode index = token row)
        rows_of = IterationRows(list(decode), drafts=plan.drafts if draft_rows else [])
        row = num_decode
        for chunk in plan.prefill:
            r = chunk.request
            prefills.append(PrefillSpan(row, chunk.length, r.slot, chunk.start))
            ids += r.prompt_token_ids[chunk.start : chunk.start + chunk.length]
            positions += range(chunk.start, chunk.start + chunk.length)
            slots += [r.slot] * chunk.length
            scored = min(chunk.length, r.prompt_len - 1 - chunk.start)  # rows that predict a prompt token
            if r.params.prompt_logprobs and scored > 0:
                rows_of.scoring.append(PromptRows(r, chunk.start + 1, scored))
                score_rows += range(row, row + scored)
            row += chunk.length
            if chunk.snapshot is not None:
                snapshots[row - 1] = chunk.snapshot
            if r.embed is not None:  # pooled, never sampled
                self._pooled_chunk(chunk, row - chunk.length, pool_rows, rows_of, types, ranked_rows)
            elif chunk.completes_prompt:
                sample_rows.append(row - 1)
                rows_of.sampled.append(r)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = ForwardBatch(
            input_ids=as_tensor(ids),
            positions=as_tensor(positions),
            write_slots=as_tensor(slots),
            num_decode=num_decode,
            decode_span=span,
            decode_rows=None if span == num_decode else as_tensor(slots[:num_decode]),  # None: slots 0..n-1
            span_lens=as_tensor(span_lens),
            max_decode_len=max(span_lens, default=0),
            prefills=prefills,
            sample_rows=as_tensor(sample_rows + score_rows + ranked_rows),
            draft_rows=draft_rows,
            snapshots=snapshots,
            pool_rows=as_tensor(pool_rows) if rows_of.pooling else None,
            token_types=as_tensor(types + [0] * (len(ids) - len(types))) if types else None,
        )
        if self.buffer.window is not None:
            bases = {r.slot: r.window_base for r in (*decode, *(c.request for c in plan.prefill))}
            batch.window = self._window_rows(batch, positions, slots, bases, [r.slot for r in decode], span_lens)
        return batch, rows_of

    def _pooled_chunk(
        self,
        chunk: PrefillChunk,
        first_row: int,
        pool_rows: list[int],
        rows_of: IterationRows,
        types: list[int],
        ranked_rows: list[int],
    ) -> None:
        """An embedding request's prompt chunk (its first token at `first_row`): the rows its
        pooling keeps join the iteration's pooled rows; a pair's rows their token types (`types`,
        the iteration's so far: rows before are type 0). A decoder reranker's pair pools nothing:
        its last row's logits are its score (`ranked_rows`)."""
        r = chunk.request
        if self.pooling.logit_tokens is not None:
            if chunk.completes_prompt:
                ranked_rows.append(first_row + chunk.length - 1)
                rows_of.ranked.append(r)
            return
        if r.embed.second_segment is not None:
            types += [0] * (first_row - len(types))
            types += [int(chunk.start + k >= r.embed.second_segment) for k in range(chunk.length)]
        kept = pooled_rows(self.pooling, chunk.start, chunk.length, r.prompt_len)
        rows_of.pooling.append(PoolRows(r, len(pool_rows), len(kept), chunk.completes_prompt))
        pool_rows += [first_row + k for k in kept]

    def _window_rows(
        self,
        batch: ForwardBatch,
        positions: list[int],
        slots: list[int],
        bases: dict[int, int],
        decoding: list[int],
        span_lens: list[int],
    ) -> ForwardBatch:
        """`batch` as the sliding-window layers see it: every position, key length and chunk start
        relative to its slot's window base (`bases`: slot -> base; `decoding`: the decoding slots)."""
        lens = list(span_lens)
        for slot in decoding:
            lens[slot] -= bases[slot]
        return dataclasses.replace(
            batch,
            positions=torch.tensor(
                [p - bases[s] for p, s in zip(positions, slots)], dtype=torch.int64, device=self.device
            ),
            span_lens=None if batch.span_lens is None else torch.tensor(lens, dtype=torch.int64, device=self.device),
            max_decode_len=max(lens, default=0),
            prefills=[dataclasses.replace(p, start_pos=p.start_pos - bases[p.slot]) for p in batch.prefills],
            _masks={},
        )

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[B, vocab block] on each rank -> [B, vocab] on the leader (blocks are padded equally)."""
        blocks = self.comm.gather_to_root(logits)  # [ranks, B, block] on the leader
        if blocks is None:
            return None
        ranks, rows, block = blocks.shape  # (rows may be 0: a prompt chunk that neither ends nor scores)
        full = blocks.permute(1, 0, 2).reshape(rows, ranks * block)
        return full[:, : self.vocab_size]

    def sample(self, logits: torch.Tensor | list[int] | None, rows: IterationRows) -> StepResult:
        """The leader samples every row at once (and scores prompts that asked); with TP it then
        broadcasts the ids (a few bytes). A list: the forward's greedy ids already. Drafts are
        checked against the ids of the rows after them (verify)."""
        result = self._sample_all_rows(logits, rows)
        result.sampled, result.scoring = rows.sampled, rows.scoring
        if not rows.drafts:
            return result
        firsts, result.accepted = verify(rows.drafts, result.token_ids, len(rows.sampled))
        owner = rows.owners()  # the request index of each row
        result.token_ids = firsts
        if result.logprobs is not None:  # requests with drafts ask for none: one entry each
            result.logprobs = [
                entry for row, entry in enumerate(result.logprobs) if row == 0 or owner[row - 1] != owner[row]
            ]
        result.failed = {owner[row]: why for row, why in result.failed.items()}
        return result

    def _sample_all_rows(self, logits: torch.Tensor | list[int] | None, rows: IterationRows) -> StepResult:
        """One id per sampled row (a drafting request has several)."""
        if not rows.sampled and not rows.scoring and not rows.ranked:  # (only prompt chunks or pooled rows)
            return StepResult()
        if isinstance(logits, list):
            return self._broadcast(logits, None, {}, [])
        if self.comm is not None:
            logits = self._gather_vocab(logits)  # the leader gets [B, vocab]; followers None
        sampled = rows.per_row()
        if not self.is_leader:  # (a follower's scheduler ends the ranked pairs too; the leader reports them)
            ranked = [(r, [0.0]) for r in rows.ranked]
            return StepResult(token_ids=self.comm.broadcast_ids(None, len(sampled)), embeddings=ranked)
        ranked = []
        if rows.ranked:  # the last rows: scores, not samples
            ranked, logits = self._ranked(logits[-len(rows.ranked) :], rows.ranked), logits[: -len(rows.ranked)]
        result = self._leader_sample(logits, rows, sampled)
        result.embeddings = ranked
        return result

    def _leader_sample(self, logits: torch.Tensor, rows: IterationRows, sampled: list[Request]) -> StepResult:
        """The leader's ids for the sampled rows (`sampled`: each row's request) and the scoring
        rows' logprobs, from the gathered logits [rows, vocab]; then broadcast."""
        if not sampled and not rows.scoring:  # (a decoder reranker's rows alone)
            return self._broadcast([], None, {}, [])
        prompt_logprobs = []
        if rows.scoring:
            prompt_logprobs = self._score_prompts(logits[len(sampled) :], rows.scoring)
            logits = logits[: len(sampled)]  # [sampled, vocab]
        penalised = any(r.params.repetition_penalty != 1.0 for r in sampled)
        counted = any(r.params.frequency_penalty or r.params.presence_penalty for r in sampled)
        want_logprobs = any(r.params.logprobs for r in sampled)
        all_greedy = all(r.params.temperature == 0 for r in sampled)
        if plain_greedy(sampled):
            # plain greedy (the common serving case): no per-row parameter tensors to gather
            if self.native is not None and logits.device.type == "cpu":
                return self._broadcast(self.native.greedy(logits), None, {}, prompt_logprobs)
            return self._broadcast(greedy(logits).tolist(), None, {}, prompt_logprobs)
        slots = torch.tensor([r.slot for r in sampled], dtype=torch.int64, device=self.device)
        allowed, failed = self._allowed(rows, logits.shape[-1])  # (a row whose structure failed: that request's)
        st = SamplingTensors(
            temperature=self._temperature[slots],
            top_k=self._top_k[slots],
            top_p=self._top_p[slots],
            min_p=self._min_p[slots],
            repetition_penalty=self._rep_penalty[slots],
            seed=self._seed[slots],
            counter=torch.tensor([len(r.output_token_ids) for r in sampled], dtype=torch.int64, device=self.device),
            all_greedy=all_greedy,
            history=[r.prompt_token_ids + r.output_token_ids for r in sampled] if penalised else None,
            want_logprobs=want_logprobs,
            top_logprobs=max((r.params.top_logprobs for r in sampled if r.params.logprobs), default=0),
            frequency_penalty=self._frequency_penalty[slots] if counted else None,
            presence_penalty=self._presence_penalty[slots] if counted else None,
            outputs=[r.output_token_ids for r in sampled] if counted else None,
            allowed=allowed,
            bias=[r.params.logit_bias for r in sampled] if any(r.params.logit_bias for r in sampled) else None,
        )
        try:
            token_ids, found = sample(logits, st, self._native_sampler(logits))
            logprobs = found.rows() if found is not None else None
        except Exception:  # a request-specific failure: find the rows responsible, sample the rest
            log.exception("sampling %d rows at once failed; sampling them one by one", len(sampled))
            token_ids, logprobs, unsampled = self._sample_row_by_row(logits, st, self._native_sampler(logits))
            failed = {**unsampled, **failed}
        return self._broadcast(token_ids.tolist(), logprobs, failed, prompt_logprobs)

    def _broadcast(self, ids: list[int], logprobs, failed: dict[int, str], prompt_logprobs: list) -> StepResult:
        """The result, after the leader's sampled ids went to the followers (tensor parallelism)."""
        if self.comm is not None and self.broadcasts_ids:
            self.comm.broadcast_ids(ids, len(ids))
        return StepResult(token_ids=ids, logprobs=logprobs, failed=failed, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _score_prompts(logits: torch.Tensor, scoring: list[PromptRows]) -> list[list[Logprob]]:
        """logits [scoring rows, vocab] -> per PromptRows, each row's (logprob, top k)."""
        targets = [t for s in scoring for t in s.request.prompt_token_ids[s.first_target : s.first_target + s.count]]
        k = max(s.request.params.top_logprobs for s in scoring)
        found = token_logprobs(logits, torch.tensor(targets, device=logits.device), k).rows()
        out, start = [], 0
        for s in scoring:
            out.append(found[start : start + s.count])
            start += s.count
        return out

    @staticmethod
    def _allowed(rows: IterationRows, vocab: int) -> tuple[torch.Tensor | None, dict]:
        """([sampled rows, words] int32: the tokens each row's structure allows (a draft's row:
        after the draft tokens before it; every bit set for rows without one), or None when no
        request has a structure; {row: why} for the rows whose structure failed)."""
        if all(r.grammar is None for r in rows.sampled):
            return None, {}
        return allowed_bits([r.grammar for r in rows.sampled], vocab, rows.request_drafts())

    def _native_sampler(self, logits: torch.Tensor):
        """The native step's sampler (the same ids, in C) where the logits are on CPU, else None."""
        return self.native.sampler if self.native is not None and logits.device.type == "cpu" else None

    @staticmethod
    def _sample_row_by_row(logits: torch.Tensor, st: SamplingTensors, native=None):
        """After sampling all rows at once failed: each alone, to find the rows responsible."""
        ids = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        logprobs: list[Logprob | None] | None = [None] * logits.shape[0] if st.want_logprobs else None
        failed = {}
        for row in range(logits.shape[0]):
            try:
                row_ids, row_logprobs = sample(logits[row : row + 1], st.row(row), native)
            except Exception as e:
                failed[row] = f"sampling failed: {e!r}"
                continue
            ids[row] = row_ids[0]
            if logprobs is not None and row_logprobs is not None:
                logprobs[row] = row_logprobs.rows()[0]
        return ids, logprobs, failed

    def score(self, ids: list[int], slot: int) -> torch.Tensor:
        """Logits [len, vocab] for every position of `ids` (teacher forcing), in `slot`: one
        forward, or chunks of the native step's max_rows (it runs every iteration)."""
        dev, n, window = self.device, len(ids), self.buffer.window
        chunk = self.native.max_rows if self.native is not None else n
        if window is not None:
            chunk, base = min(chunk, window.chunk), 0
            self.buffer.window_base[slot] = 0
        logits = []
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            batch = ForwardBatch(
                input_ids=torch.tensor(ids[start:end], device=dev),
                positions=torch.arange(start, end, device=dev),
                write_slots=torch.full((end - start,), slot, device=dev),
                num_decode=0,
                decode_span=0,
                decode_rows=None,
                span_lens=None,
                max_decode_len=0,
                prefills=[PrefillSpan(0, end - start, slot, start)],
                sample_rows=torch.arange(end - start, device=dev),
            )
            if window is not None:
                shift = window.shift(slot, base, start, end)
                if shift is not None:
                    self.buffer.apply_shifts([shift])
                    base = shift.base
                positions = list(range(start, end))
                batch.window = self._window_rows(batch, positions, [slot] * len(positions), {slot: base}, [], [])
            logits.append(self.forward(batch))
        return torch.cat(logits)


def verify(drafts: list[list[int]], row_ids: list[int], requests: int) -> tuple[list[int], dict[int, list[int]]]:
    """The ids of an iteration's sampled rows (a request's own row, then one per draft token;
    requests past len(drafts) have no draft) -> each request's first token, and the tokens after
    it that its accepted draft gives: {request index: tokens}."""
    firsts, more, row = [], {}, 0
    for i in range(requests):
        draft = drafts[i] if i < len(drafts) else ()
        ids = row_ids[row : row + 1 + len(draft)]
        firsts.append(ids[0])
        accepted = 0
        while accepted < len(draft) and draft[accepted] == ids[accepted]:
            accepted += 1
        if accepted:
            more[i] = ids[1 : accepted + 1]
        row += 1 + len(draft)
    return firsts, more
