"""A request's life: waiting -> running (prefill, then decode) -> finished."""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field
from typing import Sequence

from flover.config import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, holds no slot
    RUNNING = "running"  # holds a slot; prefilling until num_computed == prompt length
    FINISHED = "finished"  # done; its slot is freed at the next iteration boundary


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Timings:
    """Wall-clock stamps (time.perf_counter seconds) and the figures derived from them."""

    arrival: float
    scheduled: float | None = None  # first iteration that computed any of its tokens
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first (the serving benchmarks' TPOT)."""
        if self.finished is None or self.first_token is None or num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (num_output_tokens - 1)

    def as_dict(self, num_output_tokens: int) -> dict:
        return {
            "queue_time": self.queue_time,
            "ttft": self.ttft,
            "tpot": self.tpot(num_output_tokens),
            "e2e": self.e2e,
        }


@dataclass(frozen=True)
class EmbedParams:
    """An embedding request: its prompt's pooled final hidden states (models/pooling.py) come
    back instead of new tokens; it keeps no KV after."""

    dimensions: int | None = None  # only the first so many components (normalized after the cut)
    truncate_prompt_tokens: int | None = None  # a longer input keeps its first so many tokens (None: refused)
    # a reranker's (cross-encoder's) pair: the prompt is the query, this its document; the score
    # comes back as the one-component `embedding`. A pair that is too long loses document tokens.
    document: str | None = None
    # (set by the intake) a pair joined into the prompt's ids (a follower rank gets the ids so), and
    # where its tokens of type 1 begin (None: one type)
    pair: bool = False
    second_segment: int | None = None


@dataclass
class RequestInput:
    """What a caller gives for one request, before the engine validates and tokenizes it
    (ServingEngine.make_request, engine/intake.py)."""

    prompt: "str | Sequence[int] | None" = None  # text, or token ids
    params: SamplingParams | None = None  # None: SamplingParams()
    request_id: str | None = None  # None: the engine's next free number
    arrival_time: float | None = None  # time.perf_counter() of its real arrival, if earlier than now
    stream: bool = False  # text deltas with every new token
    messages: list | None = None  # a chat instead of `prompt`, rendered with the checkpoint's template
    cache_salt: str | None = None  # it shares cached prompt prefixes only with requests of the same salt
    # what tokenize(prompt, messages) already gave (an embedding's: input_ids', with the pair's second part)
    tokenized: "tuple[list[int], str | None] | tuple[list[int], str | None, int | None] | None" = None
    embed: EmbedParams | None = None  # an embedding request (prompt only, never messages)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    state: RequestState = RequestState.WAITING
    slot: int | None = None
    num_computed: int = 0  # prompt tokens whose K/V are in the cache
    cached_tokens: int = 0  # of those, copied from the prefix cache instead of computed
    prompt_saved: bool = False  # the prompt's blocks went to the prefix cache
    # recurrent layers: (block edge, snapshot row) of states taken for the prefix cache, not yet
    # attached to their blocks: at the prompt's last block edge, and at the last one decoded
    prompt_snapshot: tuple[int, int] | None = None
    decode_snapshot: tuple[int, int] | None = None
    window_base: int = 0  # first position its slot keeps for sliding-window layers (runner/kv_window.py)
    in_flight: int = 0  # pipeline stages (--pp): positions a plan still in the pipeline writes for it
    cache_salt: str | None = None  # prefix-cache partition: shared only with requests of the same salt
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # when params.logprobs
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # and top_logprobs > 0
    prompt_logprobs: list[float | None] = field(default_factory=list)  # when params.prompt_logprobs;
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)  # None first
    output_text: str = ""  # the text cut before a stop string, when one ended the request
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None  # the wire's code for `error` (None: internal_error)
    timings: Timings = field(default_factory=lambda: Timings(arrival=time.perf_counter()))
    stop_token_set: frozenset[int] = frozenset()  # EOS (unless ignored) and stop_token_ids
    detokenizer: object | None = None  # IncrementalDetokenizer, for stop strings and streaming
    stop_pattern: re.Pattern | None = None  # all stop strings in one regex: one search per token
    stop_holdback: int = 0  # longest stop string - 1: streamed text held back while it may start one
    stream: bool = False  # report text deltas as tokens arrive
    emitted: int = 0  # characters of text already reported as deltas
    drafting: object | None = None  # speculation.Drafting, once it drafts
    grammar: object | None = None  # structured.GrammarState: the structure its text must match
    embed: EmbedParams | None = None  # an embedding request: pooled, not sampled
    pooled: object | None = None  # runner/pooling.PooledRows: its kept rows so far, reduced as they come
    embedding: list[float] | None = None  # its vector, once its prompt is through

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def kv_len(self) -> int:
        """Positions of the sequence (prompt + output) whose K/V are in the slot: every token fed
        to the model, i.e. all but the last one sampled."""
        return self.num_computed if self.prefilling else self.prompt_len + max(0, len(self.output_token_ids) - 1)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def finish(self, reason: FinishReason, now: float, error: str | None = None, code: str | None = None) -> None:
        self.state = RequestState.FINISHED
        self.finish_reason = reason
        self.error, self.error_code = error, code
        self.timings.finished = now


@dataclass
class RequestOutput:
    """What a caller sees of a request after an iteration (new tokens) or at its end."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # produced by this iteration
    token_ids: list[int]  # everything produced so far
    text: str | None  # filled on the final output
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None  # of every generated token, when asked
    timings: dict
    error: str | None = None
    error_code: str | None = None  # the wire's code for `error` (None: internal_error)
    text_delta: str | None = None  # streaming requests: new text (never part of a stop string)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token: [(id, logprob)] of the top k
    prompt_logprobs: list[float | None] | None = None  # per prompt token (None for the first), when asked
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    group: int | None = None  # data-parallel groups: the engine group that ran it
    embedding: list[float] | None = None  # an embedding request's vector (its final output)

    @property
    def usage(self) -> dict:
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.token_ids),
            "cached_tokens": self.cached_tokens,
        }


# -- what one iteration gives back (the runner's result, read by the scheduler and the text half) --
Logprob = tuple[float, list[tuple[int, float]]]  # a token's log-probability, [(id, logprob)] of the top k


@dataclass
class PromptRows:
    """Rows of a prefill chunk that score its own prompt (`prompt_logprobs`): the row at prompt
    position p gives the log-probability of prompt token p + 1."""

    request: Request
    first_target: int  # prompt index of the token the first of these rows predicts
    count: int


@dataclass
class StepResult:
    """What the runner hands back for one plan: a value, so the scheduler never re-derives it."""

    sampled: list[Request] = field(default_factory=list)  # the requests that got a token, in row order
    token_ids: list[int] = field(default_factory=list)  # one per sampled request: its next token
    accepted: dict[int, list[int]] = field(default_factory=dict)  # index -> tokens its accepted draft adds
    logprobs: list[Logprob | None] | None = None  # per sampled request, when any of them asked
    failed: dict[int, str] = field(default_factory=dict)  # index -> why its sampling failed
    scoring: list[PromptRows] = field(default_factory=list)
    prompt_logprobs: list[list[Logprob]] = field(default_factory=list)  # per PromptRows (leader only)
    rows: int = 0  # tokens in the iteration's matrix; 0: no forward ran
    draft_rows: int = 0  # of them, draft tokens
    seconds: float = 0.0  # the forward and the sampling
    embeddings: list[tuple[Request, list[float]]] = field(default_factory=list)  # inputs pooled in full


@dataclass
class NewTokens:
    """The tokens one iteration appended to one request (a stop id or the length limit ends
    them; the text half may end them earlier at a stop string)."""

    request: Request
    tokens: list[int]
