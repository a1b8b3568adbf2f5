"""The temporal-fusion engine. `Engine.step()` is one iteration:

  1. retire finished/cancelled requests and compact the slot buffer (two-step shuffle);
  2. admit waiting requests FCFS while a slot is free and the token budget allows;
  3. run ONE fused forward over every token of the iteration (prompt chunks of new requests
     + one token of every running request);
  4. sample every row at once with each request's own parameters;
  5. report new tokens and mark finished requests (their slots free at the next boundary).

`LLM` is the offline API on top: `LLM(model_dir).generate(prompts, params)`.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
import time
from typing import Iterable, Sequence

import torch

from flover.config import EngineConfig, SamplingParams, threads_per_rank
from flover.kv_buffer import SlotBuffer
from flover.models import load_model, open_checkpoint
from flover.models.attention import ForwardBatch, PrefillSpan
from flover.parallel.comm import Communicator
from flover.parallel.layout import TPLayout
from flover.parallel.plan import AddEvent, StepPlanMessage
from flover.request import FinishReason, Request, RequestOutput, RequestState, Timings
from flover.sampler import SamplingTensors, sample
from flover.scheduler import Scheduler, StepPlan
from flover.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "float64": torch.float64}


class PromptTooLong(ValueError):
    """prompt + max_new_tokens does not fit in max_seq_len (refused, never truncated)."""


class Engine:
    """One persistent inference instance: model weights, the slot buffer and the scheduler."""

    def __init__(self, config: EngineConfig, comm: Communicator | None = None):
        """`comm`: the tensor-parallel communicator when this is one rank of several (rank 0
        leads: it alone takes requests and samples; the others follow its step plans)."""
        config.validate()
        self.config = config
        self.comm = comm if comm is not None and comm.size > 1 else None
        self.is_leader = self.comm is None or self.comm.rank == 0
        ranks = self.comm.size if self.comm else 1
        torch.set_num_threads(config.num_threads or threads_per_rank(ranks))
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        checkpoint = open_checkpoint(config.model)  # a Hugging Face directory or a GGUF file
        self.model_config = cfg = checkpoint.model_config()
        self.tp = TPLayout.build(cfg, self.comm.rank if self.comm else 0, ranks)
        self.max_seq_len = config.max_seq_len or min(cfg.max_position_embeddings, 2048)
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={self.max_seq_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self.model = load_model(checkpoint, self.dtype, self.device, self.max_seq_len, cfg, tp=self.tp,
                                comm=self.comm, pack_hint=config.max_slots)
        self.tokenizer = load_tokenizer(checkpoint)
        self.buffer = SlotBuffer(cfg.num_layers, config.max_slots, self.tp.kv_heads, self.max_seq_len,
                                 cfg.head_dim, self.dtype, self.device)
        if self.is_leader:
            log.info("KV cache: %.1f MiB allocated%s (%d slots x %d positions, %s)", self.buffer.nbytes / 2**20,
                     f" per rank x {ranks} ranks" if ranks > 1 else "", config.max_slots, self.max_seq_len,
                     config.dtype)
        state = self.buffer.add_state
        self._seq_len = state("seq_len", torch.int64)  # tokens of the slot already in the cache
        self._last_token = state("last_token", torch.int64)  # next decode input
        self._generated = state("generated", torch.int64)  # tokens sampled so far
        self._temperature = state("temperature", torch.float32)
        self._top_k = state("top_k", torch.int64)
        self._top_p = state("top_p", torch.float32, 1.0)
        self._min_p = state("min_p", torch.float32)
        self._rep_penalty = state("repetition_penalty", torch.float32, 1.0)
        self._seed = state("seed", torch.int64)
        self.scheduler = Scheduler(config.max_slots, config.max_batch_tokens)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs of requests cancelled between steps
        self._plan = StepPlanMessage()  # intake since the last iteration, for the other ranks
        self.stopped = False  # a follower saw the leader's shutdown
        self.iterations = 0
        self.last_step_tokens = 0  # rows of the last iteration's token matrix (stats, benchmarks)

    # -- intake ---------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it joins the running batch at the next iteration. Raises
        ValueError (and changes nothing) when the request cannot be served."""
        return self.enqueue(self.make_request(prompt, params, request_id))

    def make_request(self, prompt: str | Sequence[int] | None, params: SamplingParams | None = None,
                     request_id: str | None = None, arrival_time: float | None = None,
                     stream: bool = False, messages: list | None = None) -> Request:
        """Validate and tokenize; raises ValueError naming what is wrong. Queues nothing.
        `messages` (instead of `prompt`): chat messages, rendered with the checkpoint's template.
        `arrival_time` (time.perf_counter) is when the request really arrived, if earlier than now:
        latencies count from it. `stream`: report text deltas with every new token."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        token_ids, text = self._prompt_ids(prompt) if messages is None else (self._chat_ids(messages), None)
        limit = self.max_seq_len
        if len(token_ids) + params.max_new_tokens > limit:
            raise PromptTooLong(f"prompt of {len(token_ids)} tokens + max_new_tokens={params.max_new_tokens} "
                             f"exceeds max_seq_len={limit}; shorten the prompt or lower max_new_tokens")
        if (params.stop or stream) and self.tokenizer is None:
            raise ValueError("stop strings and streamed text need the checkpoint's tokenizer")
        eos = params.eos_token_ids if params.eos_token_ids is not None else self.model_config.eos_token_ids
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, params=params, prompt=text,
            stop_token_set=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos)),
            detokenizer=IncrementalDetokenizer(self.tokenizer) if params.stop or stream else None, stream=stream,
            timings=Timings(arrival=time.perf_counter() if arrival_time is None else arrival_time),
        )
        if params.stop:
            request.stop_pattern = re.compile("|".join(map(re.escape, params.stop)))
            request.stop_holdback = max(map(len, params.stop)) - 1
        return request

    def enqueue(self, request: Request) -> str:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        if self._tells_followers:
            self._plan.add(AddEvent(request.request_id, request.prompt_token_ids, request.params))
        return request.request_id

    def _prompt_ids(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need the checkpoint's tokenizer; pass token ids")
            self._check_text_size(prompt)
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            if len(prompt) > self.max_seq_len:  # before looking at a million ids one by one
                raise PromptTooLong(f"prompt of {len(prompt)} tokens exceeds max_seq_len={self.max_seq_len}")
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        else:
            raise ValueError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids, text

    def _check_text_size(self, text: str) -> None:
        """Refuse, without tokenizing it, a text that cannot fit: it needs at least
        bytes / (longest token in bytes) tokens. Bounds the tokenizer work one request can cost."""
        size, longest = len(text.encode("utf-8", "surrogatepass")), self.tokenizer.max_token_bytes
        if size > self.max_seq_len * longest:
            raise PromptTooLong(f"prompt of {size} bytes cannot fit in max_seq_len={self.max_seq_len} tokens "
                                f"(no token is longer than {longest} bytes); refused before tokenizing")

    def _chat_ids(self, messages: list) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("messages need the checkpoint's tokenizer")
        text = self.tokenizer.render_chat(messages)
        self._check_text_size(text)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its final output comes with the next step(). False if unknown/done."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        was_waiting = request.state is RequestState.WAITING
        self.scheduler.cancel(request, time.perf_counter())
        if self._tells_followers:
            self._plan.cancel(request_id)
        self._pending.append(self._output(request, []))
        if was_waiting:  # never got a slot, so no retire step will forget it
            del self.requests[request_id]
        return True

    def has_unfinished(self) -> bool:
        return bool(self._pending) or any(not r.finished for r in self.requests.values())

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len, vocab] for every position of `token_ids` (teacher forcing), through the
        same forward pass as step(), in a slot above the live range: running requests are not
        disturbed. For evaluation and reference checks."""
        ids, _ = self._prompt_ids(token_ids)
        slot = self.scheduler.num_live
        if slot >= self.config.max_slots or len(ids) > self.max_seq_len:
            raise ValueError("no free slot, or the sequence is longer than max_seq_len")
        dev, n = self.device, len(ids)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev), positions=torch.arange(n, device=dev),
            write_slots=torch.full((n,), slot, device=dev), num_decode=0, decode_span=0,
            decode_rows=None, span_lens=None, max_decode_len=0, prefills=[PrefillSpan(0, n, slot, 0)],
            sample_rows=torch.arange(n, device=dev))
        return self.model(batch, self.buffer.kv)

    # -- tensor parallelism: the leader's plan, the followers' loop --------------------------
    @property
    def _tells_followers(self) -> bool:
        """The leader of several ranks: its intake goes into the next step plan."""
        return self.comm is not None and self.is_leader

    def _exchange_plan(self) -> None:
        """Leader: broadcast the intake since the last iteration. Follower: wait (without
        spinning) for it and apply it, so that its scheduler makes the leader's decisions."""
        if self.is_leader:
            self.comm.broadcast_bytes(self._plan.encode())
            self._plan = StepPlanMessage()
            return
        message = StepPlanMessage.decode(self.comm.broadcast_bytes(None))
        for event in message.events:
            if isinstance(event, AddEvent):
                self.enqueue(self.make_request(event.token_ids, event.params, event.request_id))
            else:
                self.abort(event)
        self._pending.clear()
        self.stopped = message.shutdown

    def follow(self) -> None:
        """A follower rank's whole life: run the leader's iterations until it shuts down."""
        assert not self.is_leader
        while not self.stopped:
            self.step()

    def shutdown(self) -> None:
        """Leader: release the followers (their follow() returns). Requests in flight are dropped."""
        if self._tells_followers and not self.stopped:
            self._plan.shutdown = True
            self.comm.broadcast_bytes(self._plan.encode())
            self.stopped = True

    # -- one iteration --------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self.comm is not None:
            self._exchange_plan()
            if self.stopped:
                return []
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        for request in plan.retired:
            self.requests.pop(request.request_id, None)
        if plan.moves:
            used = max(int(self._seq_len[m.src]) for m in plan.moves)  # cached positions of the moved slots
            self.buffer.apply_moves(plan.moves, positions=max(1, used))
        if plan.empty:
            return outputs
        now = time.perf_counter()
        self._admit(plan, now)
        batch, sampled = self._build_batch(plan)
        self.last_step_tokens = batch.input_ids.shape[0]
        logits = self.model(batch, self.buffer.kv)  # [B, vocab]: the one fused forward
        self.scheduler.commit(plan)
        self._advance_lengths(plan, batch)
        if self.comm is not None:
            logits = self._gather_vocab(logits)  # the leader gets [B, vocab]; followers None
        token_ids, logprobs, failed = self._sample(logits, sampled, batch)
        self.iterations += 1
        outputs += self._record(sampled, token_ids, logprobs, failed, time.perf_counter())
        return outputs

    def _admit(self, plan: StepPlan, now: float) -> None:
        """Write the per-slot state of requests that got a slot in this plan."""
        for chunk in plan.prefill:
            if chunk.start != 0:
                continue
            r, slot, p = chunk.request, chunk.request.slot, chunk.request.params
            r.timings.scheduled = now
            self._seq_len[slot] = 0
            self._generated[slot] = 0
            self._temperature[slot] = p.temperature
            self._top_k[slot] = p.top_k
            self._top_p[slot] = p.top_p
            self._min_p[slot] = p.min_p
            self._rep_penalty[slot] = p.repetition_penalty
            self._seed[slot] = p.seed if p.seed is not None else self._rng.getrandbits(63)

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[Request]]:
        """The iteration's token matrix: decode tokens in slot order, then the prefill chunks."""
        dev = self.device
        num_decode = len(plan.decode)
        decode_slots = [r.slot for r in plan.decode]
        contiguous = num_decode == 0 or decode_slots[-1] == num_decode - 1
        span = decode_slots[-1] + 1 if num_decode else 0
        if contiguous:
            rows, slot_index = None, slice(0, num_decode)
            span_lens = self._seq_len[:span] + 1
        else:
            rows = torch.tensor(decode_slots, device=dev)
            slot_index = rows
            span_lens = torch.ones(span, dtype=torch.int64, device=dev)
            span_lens[rows] = self._seq_len[rows] + 1
        ids = [self._last_token[slot_index]]
        positions = [self._seq_len[slot_index]]
        slots = [torch.arange(num_decode, device=dev) if contiguous else rows]

        prefills, prefill_ids, sample_rows = [], [], list(range(num_decode))
        sampled = list(plan.decode)
        row = num_decode
        for chunk in plan.prefill:
            r = chunk.request
            prefills.append(PrefillSpan(row, chunk.length, r.slot, chunk.start))
            prefill_ids += r.prompt_token_ids[chunk.start: chunk.start + chunk.length]
            positions.append(torch.arange(chunk.start, chunk.start + chunk.length, device=dev))
            slots.append(torch.full((chunk.length,), r.slot, dtype=torch.int64, device=dev))
            row += chunk.length
            if chunk.completes_prompt:
                sample_rows.append(row - 1)
                sampled.append(r)
        if prefill_ids:
            ids.append(torch.tensor(prefill_ids, dtype=torch.int64, device=dev))
        max_len = max((r.prompt_len + len(r.output_token_ids) for r in plan.decode), default=0)
        batch = ForwardBatch(
            input_ids=torch.cat(ids), positions=torch.cat(positions), write_slots=torch.cat(slots),
            num_decode=num_decode, decode_span=span, decode_rows=rows, span_lens=span_lens,
            max_decode_len=max_len, prefills=prefills,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )
        return batch, sampled

    def _advance_lengths(self, plan: StepPlan, batch: ForwardBatch) -> None:
        d = batch.num_decode
        if d:
            index = slice(0, d) if batch.decode_rows is None else batch.decode_rows
            self._seq_len[index] += 1
        for chunk in plan.prefill:
            self._seq_len[chunk.request.slot] = chunk.start + chunk.length

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[B, vocab block] on each rank -> [B, vocab] on the leader (blocks are padded equally)."""
        blocks = self.comm.gather_to_root(logits)  # [ranks, B, block] on the leader
        if blocks is None:
            return None
        full = blocks.permute(1, 0, 2).reshape(logits.shape[0], -1)
        return full[:, : self.model_config.vocab_size]

    def _sample(self, logits: torch.Tensor | None, sampled: list[Request], batch: ForwardBatch):
        """The leader samples every row at once; with TP it then broadcasts the ids (a few bytes).
        Returns (ids, logprobs or None, {row: why} for rows whose sampling failed)."""
        slots = torch.tensor([r.slot for r in sampled], dtype=torch.int64, device=self.device)
        if not self.is_leader:
            ids = self.comm.broadcast_ids(None, len(sampled))
            self._last_token[slots] = torch.tensor(ids, device=self.device)
            self._generated[slots] += 1
            return ids, None, {}
        penalised = any(r.params.repetition_penalty != 1.0 for r in sampled)
        st = SamplingTensors(
            temperature=self._temperature[slots], top_k=self._top_k[slots], top_p=self._top_p[slots],
            min_p=self._min_p[slots], repetition_penalty=self._rep_penalty[slots], seed=self._seed[slots],
            counter=self._generated[slots],
            all_greedy=all(r.params.temperature == 0 for r in sampled),
            history=[r.prompt_token_ids + r.output_token_ids for r in sampled] if penalised else None,
            want_logprobs=any(r.params.logprobs for r in sampled),
        )
        failed: dict[int, str] = {}
        try:
            token_ids, logprobs = sample(logits, st)
        except Exception:  # a request-specific failure: find the rows responsible, sample the rest
            log.exception("sampling %d rows at once failed; sampling them one by one", len(sampled))
            token_ids, logprobs, failed = self._sample_rows(logits, st)
        self._last_token[slots] = token_ids
        self._generated[slots] += 1
        ids = token_ids.tolist()
        if self.comm is not None:
            self.comm.broadcast_ids(ids, len(ids))
        return ids, (logprobs.tolist() if logprobs is not None else None), failed

    @staticmethod
    def _sample_rows(logits: torch.Tensor, st: SamplingTensors):
        ids = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        logprobs = torch.full((logits.shape[0],), float("nan"), device=logits.device) if st.want_logprobs else None
        failed = {}
        for row in range(logits.shape[0]):
            try:
                row_ids, row_logprobs = sample(logits[row: row + 1], st.row(row))
            except Exception as e:
                failed[row] = f"sampling failed: {e!r}"
                continue
            ids[row] = row_ids[0]
            if logprobs is not None and row_logprobs is not None:
                logprobs[row] = row_logprobs[0]
        return ids, logprobs, failed

    def _record(self, sampled: list[Request], token_ids: list[int], logprobs: list[float] | None,
                failed: dict[int, str], now: float) -> list[RequestOutput]:
        """Append each request's new token, decide whether it is finished, and report it. A
        failure that belongs to one request (its sampling, its text) ends that request alone."""
        outputs = []
        for i, (r, token) in enumerate(zip(sampled, token_ids)):
            if i in failed:
                outputs.append(self._fail(r, failed[i], now))
                continue
            try:
                outputs.append(self._record_one(r, token, logprobs[i] if logprobs is not None else None, now))
            except Exception as e:
                log.exception("request %s failed", r.request_id)
                outputs.append(self._fail(r, f"internal error: {e!r}", now))
        return outputs

    def _record_one(self, r: Request, token: int, logprob: float | None, now: float) -> RequestOutput:
        r.output_token_ids.append(token)
        if logprob is not None and r.params.logprobs:
            r.output_logprobs.append(logprob)
        if r.timings.first_token is None:
            r.timings.first_token = now
        delta = r.detokenizer.add(token) if r.detokenizer is not None else ""
        if token in r.stop_token_set:
            r.finish(FinishReason.STOP, now)
        elif delta and r.stop_pattern is not None and self._hit_stop_string(r, delta):
            r.finish(FinishReason.STOP, now)
        elif len(r.output_token_ids) >= r.params.max_new_tokens:
            r.finish(FinishReason.LENGTH, now)
        return self._output(r, [token])

    def _fail(self, r: Request, why: str, now: float) -> RequestOutput:
        """End one request with finish reason `error`; the other ranks retire it with the leader."""
        r.finish(FinishReason.ERROR, now, error=why)
        if self._tells_followers:
            self._plan.cancel(r.request_id)
        return RequestOutput(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, new_token_ids=[],
                             token_ids=list(r.output_token_ids), text=None, finished=True, finish_reason="error",
                             logprobs=None, timings=r.timings.as_dict(len(r.output_token_ids)), error=why)

    @staticmethod
    def _hit_stop_string(r: Request, delta: str) -> bool:
        """One regex search over the new text and the `stop_holdback` characters before it."""
        text = r.detokenizer.text
        match = r.stop_pattern.search(text, max(0, len(text) - len(delta) - r.stop_holdback))
        if match:
            r.output_text = text[: match.start()]  # the stop string itself is never returned
            return True
        return False

    def _output(self, r: Request, new_tokens: list[int]) -> RequestOutput:
        text = None
        if r.finished and self.tokenizer is not None:
            stopped_by_string = r.params.stop and r.finish_reason is FinishReason.STOP \
                and r.output_token_ids and r.output_token_ids[-1] not in r.stop_token_set
            text = r.output_text if stopped_by_string else self.tokenizer.decode(r.output_token_ids)
        return RequestOutput(
            text_delta=self._text_delta(r, text) if r.stream else None,
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, new_token_ids=new_tokens,
            token_ids=list(r.output_token_ids), text=text, finished=r.finished,
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            logprobs=r.output_logprobs if r.params.logprobs else None,
            timings=r.timings.as_dict(len(r.output_token_ids)), error=r.error,
        )

    @staticmethod
    def _text_delta(r: Request, final_text: str | None) -> str:
        """Text not yet reported. While running, the last (longest stop string - 1) characters
        are held back: they might be the start of a stop string, which is never emitted."""
        if r.finished:
            end = len(final_text or "")
            delta = (final_text or "")[r.emitted:]
        else:
            end = max(r.emitted, len(r.detokenizer.text) - r.stop_holdback)
            delta = r.detokenizer.text[r.emitted:end]
        r.emitted = end
        return delta


class LLM:
    """Offline API, as in vLLM: `LLM(model_dir).generate(prompts, params)`."""

    def __init__(self, model: str, **engine_options):
        self.engine = Engine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Iterable[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt through the engine (fused, as slots allow) and return the final
        outputs in prompt order. `params` is one SamplingParams for all or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        requests = []
        for n, (prompt, p) in enumerate(zip(prompts, params)):
            try:  # validate everything before queueing anything
                requests.append(engine.make_request(prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {n}: {e}") from None
        ids = [engine.enqueue(r) for r in requests]
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[i] for i in ids]
