"""Contracts between the parts: how a request wants to be sampled, how the engine is sized."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace

from flover.chat_template import TemplateLimits
from flover.flags import flag
from flover.structured.spec import GrammarLimits, Structured

KV_KINDS = ("q8_0", "q4_0")  # --kv-dtype's blocks (models/kv_codes.py)


def kv_kinds(spec: str) -> tuple[str, str] | None:
    """--kv-dtype's K and V kinds: "auto" (the model's dtype: None), "q8_0", or "q8_0,q4_0" (K, V).
    ValueError naming what is wrong."""
    if spec == "auto":
        return None
    kinds = tuple(spec.split(","))
    kinds = kinds * 2 if len(kinds) == 1 else kinds
    if len(kinds) != 2 or any(k not in KV_KINDS for k in kinds):
        raise ValueError(f"kv_dtype={spec!r}: auto, or K[,V] of {', '.join(KV_KINDS)} (e.g. q8_0 or q8_0,q4_0)")
    return kinds


# What one request may ask for. Every value must fit the engine's per-slot tensors (int64 /
# float32) and keep the sampler's arithmetic finite; the per-token stop check must stay cheap.
# docs/protocol.md lists these limits.
MAX_INT32 = 2**31 - 1
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_TEMPERATURE = 1e4
GREEDY_BELOW = 1e-5  # smaller positive temperatures are greedy (as in vLLM): 1/T would overflow
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # seen logits are scaled by at most 100x either way
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_TOKEN_ID_LIST = 1024  # entries of stop_token_ids / eos_token_ids
MAX_REQUEST_ID_LENGTH = 256  # characters of a client-chosen request id (protocol, prompt files)
MAX_TOP_LOGPROBS = 20  # alternatives reported per token (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (names follow vLLM's SamplingParams).

    temperature == 0 means greedy; the default is greedy so that a plain call gives the same
    tokens as transformers' `generate` on the same weights. Every field is checked strictly
    (types are never coerced) and against the limits above, here and nowhere else.
    """

    max_new_tokens: int | None = 16  # None: up to the end of the context
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off (transformers' definition)
    frequency_penalty: float = 0.0  # OpenAI's: logit -= this x times the token was generated
    presence_penalty: float = 0.0  # OpenAI's: logit -= this if the token was generated at all
    seed: int | None = None  # same seed => same tokens, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; never part of the returned text
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] | None = None  # None = the checkpoint's EOS ids
    logprobs: bool = False  # return the log-probability of every sampled token
    prompt_logprobs: bool = False  # and of every prompt token after the first (teacher forcing)
    top_logprobs: int = 0  # with either: the k most likely tokens at each of those positions
    structured: Structured | None = None  # what the text must match (docs/structured_output.md)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples; nothing else is converted.
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if isinstance(self.stop, str):
            set_("stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "eos_token_ids"):
            value = getattr(self, name)
            if isinstance(value, list):
                set_(name, tuple(value))
        if self.structured is not None:  # the wire's map, checked for its shape
            set_("structured", Structured.of(self.structured))
        if isinstance(self.logit_bias, dict):  # {id: bias}, as OpenAI's (its JSON keys already ids)
            set_("logit_bias", tuple(sorted(self.logit_bias.items())))
        elif isinstance(self.logit_bias, list):  # the wire's [[id, bias], ...]
            set_("logit_bias", tuple(tuple(pair) if isinstance(pair, list) else pair for pair in self.logit_bias))
        self.validate()
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            set_(name, float(getattr(self, name)))  # validated: an int within float32's range
        if self.temperature < GREEDY_BELOW:
            set_("temperature", 0.0)

    def validate(self) -> None:  # noqa: C901 (a flat list of field checks)
        """Raise ValueError naming the first bad field."""

        def bad(name: str, why: str) -> None:
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValueError(f"SamplingParams.{name}={shown}: {why}")

        if self.max_new_tokens is not None and not int_in(self.max_new_tokens, 1, MAX_INT32):
            bad("max_new_tokens", f"must be an integer in [1, {MAX_INT32}] or null (the rest of the context)")
        if not _number_in(self.temperature, 0, MAX_TEMPERATURE):
            bad(
                "temperature",
                f"must be a number in [0, {MAX_TEMPERATURE:g}] (0: greedy; below {GREEDY_BELOW:g}: greedy too)",
            )
        if not int_in(self.top_k, 0, MAX_INT32):
            bad("top_k", f"must be an integer in [0, {MAX_INT32}] (0 disables it)")
        if not _number_in(self.top_p, 0, 1) or self.top_p == 0:
            bad("top_p", "must be a number in (0, 1]")
        if not _number_in(self.min_p, 0, 1):
            bad("min_p", "must be a number in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        if not _number_in(self.repetition_penalty, low, high):
            bad("repetition_penalty", f"must be a number in [{low:g}, {high:g}] (1 disables it)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _number_in(getattr(self, name), -2, 2):
                bad(name, "must be a number in [-2, 2] (OpenAI's range; 0 disables it)")
        if self.seed is not None and not int_in(self.seed, 0, 2**63 - 1):
            bad("seed", "must be an integer in [0, 2**63) or null")
        for name in ("stop_token_ids", "eos_token_ids"):
            value = getattr(self, name)
            if value is None and name == "eos_token_ids":
                continue
            if not isinstance(value, tuple) or not all(int_in(t, 0, MAX_INT32) for t in value):
                bad(name, f"must be a list of integers in [0, {MAX_INT32}]")
            if len(value) > MAX_TOKEN_ID_LIST:
                bad(name, f"at most {MAX_TOKEN_ID_LIST} token ids")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters")
        for name in ("ignore_eos", "logprobs", "prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if not int_in(self.top_logprobs, 0, MAX_TOP_LOGPROBS):
            bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not (self.logprobs or self.prompt_logprobs):
            bad("top_logprobs", "needs logprobs or prompt_logprobs set to true")
        if not _logit_bias_ok(self.logit_bias):
            bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} distinct token ids to numbers in [-100, 100]")

    @property
    def may_draft(self) -> bool:
        """Greedy without penalties or log-probabilities: each row's id is the largest of its own
        logits (masked by the structure, biased), so a speculative draft can be checked."""
        return (
            self.temperature == 0
            and self.repetition_penalty == 1.0
            and not self.frequency_penalty
            and not self.presence_penalty
            and not self.logprobs
        )

    @property
    def plain_greedy(self) -> bool:
        """Takes the largest logit as is (the common serving case): no temperature, penalty or
        log-probabilities, no structure or bias: the native step's head may pick the id itself."""
        return self.may_draft and self.structured is None and not self.logit_bias

    def with_updates(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias_ok(bias) -> bool:
    """At most MAX_LOGIT_BIAS (token id, bias) pairs, distinct ids in the int32 range, biases in [-100, 100]."""
    return (
        isinstance(bias, tuple)
        and len(bias) <= MAX_LOGIT_BIAS
        and all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and int_in(pair[0], 0, MAX_INT32)
            and _number_in(pair[1], -100, 100)
            for pair in bias
        )
        and len({pair[0] for pair in bias}) == len(bias)
    )


def int_in(value, low: int, high: int) -> bool:
    return is_int(value) and low <= value <= high


def _number_in(value, low: float, high: float) -> bool:
    """An int or float (never a bool or a string), finite, in [low, high]. Ints are compared
    exactly, so 2**64 never reaches a float conversion."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (is_int(value) or math.isfinite(value)) and low <= value <= high


SAMPLING_KEYS = frozenset(SamplingParams.field_names())  # what a request may set per request

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")  # auto: flover/hardware.py
QUANTIZATIONS = ("auto", "none", "int8", "int4", "file")  # weight-only, flover/models/quant.py
# Decode-only iterations from captured CUDA graphs (flover/runner/cuda_graphs.py). auto: on CUDA at
# TP=1; eager: the same padded static batches without capture, on any device (tests).
CUDA_GRAPHS = ("auto", "off", "eager")
# Iterations as one native call (flover/native/forward.py). auto: on CPU at
# any TP in float32/bfloat16 (quantized or not), when a C compiler is there.
NATIVE_FORWARD = ("auto", "off")
POOLING_MODES = ("mean", "cls", "last", "max", "mean_sqrt_len")  # embeddings' (flover/models/pooling.py)
RANK = "rank"  # --pooling's other choice: a decoder as a reranker (llama.cpp's name for rank pooling)
NATIVE_KERNELS = ("auto", "avx512bf16", "avx512vnni", "avx512", "avx2", "neon", "generic")


def default_num_threads() -> int:
    """Cores this process may run on (respects taskset/cgroups affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(ranks: int) -> int:
    """Default torch threads for one of `ranks` processes on this machine: the cores it is bound to
    when mpirun bound it, else an equal share of the cores available."""
    cores = default_num_threads()
    bound = cores < (os.cpu_count() or cores)
    return cores if bound or ranks == 1 else max(1, cores // ranks)


@dataclass
class EngineConfig:
    """How one engine instance is sized. Everything is fixed at start-up."""

    model: str
    dtype: str = field(
        default="auto",
        metadata=flag(
            "--dtype", "auto (default): bfloat16 where the CPU/GPU computes it natively, else float32", choices=DTYPES
        ),
    )
    device: str = field(default="cpu", metadata=flag("--device", "cpu, cuda, cuda:N"))
    quantization: str = field(
        default="auto",
        metadata=flag(
            "--quantization",
            "weight-only int8/int4 projections for fast single streams (CPU, bfloat16); file: a GGUF "
            "file's projections keep their own codes (Q2_K ... Q6_K, Q4_0 ... Q8_0, IQ4_NL, IQ4_XS, MXFP4); "
            "auto (default): file where the native step runs in bfloat16 and the file allows, else "
            "none (none: dequantized to the dtype)",
            choices=QUANTIZATIONS,
        ),
    )
    max_slots: int = field(default=32, metadata=flag("--max-slots", "requests in flight at once"))
    max_seq_len: int | None = field(  # None = min(model limit, 2048)
        default=None, metadata=flag("--max-seq-len", "prompt + output tokens (default: model limit, <= 2048)", type=int)
    )
    max_batch_tokens: int = field(  # prompts are chunked to fit
        default=512, metadata=flag("--max-batch-tokens", "token budget of one iteration")
    )
    # while prompts wait, up to this many iterations in a row run prompts alone (scheduler.PromptFirst;
    # 0: every iteration decodes), each of at most prompt_first_tokens
    prompt_first_iterations: int = field(
        default=3,
        metadata=flag(
            "--prompt-first",
            "while prompts wait, up to N iterations in a row run prompt tokens alone before the running "
            "requests decode again (lower time to first token under bursts; default 3; 0: every "
            "iteration decodes)",
            metavar="N",
        ),
    )
    prompt_first_tokens: int = field(
        default=192, metadata=flag("--prompt-first-tokens", "prompt tokens of one such iteration (default 192)")
    )
    num_threads: int | None = field(
        default=None,
        metadata=flag(
            "--threads", "torch threads (default: the cores available, shared by the ranks on this node)", type=int
        ),
    )
    # prompt-lookup speculation (flover/engine/speculation.py). Asked for where it cannot, the engine
    # says so and runs without.
    speculate: int | None = field(
        default=None,
        metadata=flag(
            "--speculate",
            "prompt-lookup speculation: greedy requests draft up to K tokens per iteration from where "
            "their last tokens occurred before (prompt or output), checked by the same forward: the "
            "same tokens in fewer iterations (default: 8 where the native CPU step runs, on every "
            "rank under TP; else off; 0: off)",
            type=int,
            metavar="K",
        ),
    )
    speculate_ngram: int = field(
        default=3,
        metadata=flag("--speculate-ngram", "the last N tokens are looked up for a draft (default 3)", metavar="N"),
    )
    seed: int = field(default=0, metadata=flag("--seed", "seeds requests that bring no seed"))
    embed_share: float = field(
        default=0.25,
        metadata=flag(
            "--embed-share",
            "beside decoding requests, embedding inputs take rows worth at most this share of an "
            "iteration's time (by its fitted cost), at least one row: the decoding requests' time per "
            "token grows by about it (default 0.25; without decoding requests they take the whole budget)",
            type=float,
            metavar="F",
        ),
    )
    pooling: str | None = field(
        default=None,
        metadata=flag(
            "--pooling",
            "embeddings from any decoder: its final hidden states pooled (mean, cls, last: the last token's, "
            "max, mean_sqrt_len), normalized (default: as a sentence-transformers directory's modules.json "
            "or a GGUF file's pooling_type says; a model that says none serves no embeddings); or rank: a "
            "decoder as a reranker (Qwen3-Reranker's uploads), as sentence-transformers' CrossEncoder "
            "loads one: each (query, document) pair rendered by the chat template, scored by the last "
            "token's logit of 'yes' minus 'no', sigmoid",
            choices=(*POOLING_MODES, RANK),
        ),
    )
    prefix_cache_mib: float = field(
        default=256,
        metadata=flag(
            "--prefix-cache",
            "MiB (per rank) of KV blocks of recent prompts kept for reuse by later prompts that start "
            "the same way (LRU; default 256; 0 turns it off)",
            type=float,
            metavar="MIB",
        ),
    )
    kv_dtype: str = field(
        default="auto",
        metadata=flag(
            "--kv-dtype",
            "the KV cache's rows: auto (the model's dtype), or q8_0 / q4_0 for K and V, or K,V apart "
            "(e.g. q8_0,q4_0): llama.cpp's blocks of 32 behind a float16 scale (-ctk / -ctv), 1.06 and "
            "0.56 bytes a value where bfloat16 takes 2; heads of a multiple of 32 dims, on the CPU",
            metavar="K[,V]",
        ),
    )
    prefix_cache_dir: str | None = field(
        default=None,
        metadata=flag(
            "--prefix-cache-dir",
            "also keep the prefix cache's blocks in this directory, written as they are stored: a later "
            "process with the same model file, dtype and KV layout starts from them (the first turn "
            "after a restart hits). A file of another model, dtype or build, a truncated or a changed "
            "one is ignored with a warning (one rank only: not with --tp or --pp)",
            metavar="DIR",
        ),
    )
    prefix_cache_disk_mib: float = field(
        default=4096,
        metadata=flag(
            "--prefix-cache-disk",
            "MiB of files --prefix-cache-dir keeps (least recently used go first; default 4096)",
            type=float,
            metavar="MIB",
        ),
    )
    # Touch the prefix pool's pages at start-up: faulted in one by one, its first stores cost page
    # faults inside iterations; left lazy, memory grows as it fills. (A flag of `flover serve` only.)
    prefault_prefix_cache: bool = field(
        default=False,
        metadata=flag(
            "--prefault-prefix-cache",
            "take the prefix cache's memory at start-up instead of as it fills (its first stores "
            "then cost no page faults inside iterations: ~1.5%% of a fresh daemon's time)",
        ),
    )
    # Sliding-window layers keep every position, as full layers do (llama.cpp's --swa-full). Default:
    # they keep about their window (flover/runner/kv_window.py).
    full_window_kv: bool = field(
        default=False,
        metadata=flag(
            "--full-window-kv",
            "sliding-window layers (Gemma 3, Mistral's window) keep every position, not about their "
            "window: more memory, more prefix-cache hits on long shared prompts (llama.cpp's --swa-full)",
        ),
    )
    cuda_graphs: str = field(  # one of CUDA_GRAPHS
        default="auto",
        metadata=flag(
            "--cuda-graphs",
            "auto (default): on CUDA at TP=1, decode-only iterations replay graphs captured at start-up",
            choices=("auto", "off"),
        ),
    )
    native_forward: str = field(  # one of NATIVE_FORWARD
        default="auto",
        metadata=flag(
            "--native-forward",
            "auto (default): on CPU (float32/bfloat16, quantized or not; each rank's shard under TP), "
            "iterations run as one native call compiled for this CPU on first use (needs a C compiler)",
            choices=NATIVE_FORWARD,
        ),
    )
    # the native step's kernel family (flover/native/simd.h); FLOVER_NATIVE_KERNELS overrides auto
    native_kernels: str = field(
        default="auto",
        metadata=flag(
            "--native-kernels",
            "the native step's kernel family: auto (default) = the widest this CPU "
            "runs; another forces it where the CPU can run it (side-by-side runs with llama.cpp built for "
            "the same instruction set). The FLOVER_NATIVE_KERNELS variable overrides auto",
            choices=NATIVE_KERNELS,
        ),
    )
    # with the native step, keep PyTorch's copy of the projections too (twice the weight memory):
    # for comparing the two forwards on one engine (tests)
    keep_pytorch_weights: bool = False
    # what one request's structure may cost (flover/structured/spec.py GrammarLimits, docs/hardening.md)
    grammar_limits: GrammarLimits = GrammarLimits()
    # what rendering one chat with the model's template may cost (flover/chat_template.py)
    template_limits: TemplateLimits = TemplateLimits()
    stage_timeout: float = field(
        default=60.0,
        metadata=flag(
            "--stage-timeout",
            "pipeline stages: a stage whose rows do not come back within S seconds (frozen, its host "
            "gone silent) ends the job: every request in flight gets an engine_unresponsive error first",
            metavar="S",
        ),
    )

    def validate(self) -> None:
        choices = {
            "dtype": DTYPES,
            "quantization": QUANTIZATIONS,
            "cuda_graphs": CUDA_GRAPHS,
            "native_forward": NATIVE_FORWARD,
            "native_kernels": NATIVE_KERNELS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        if self.max_slots < 1:
            raise ValueError(f"max_slots={self.max_slots}: must be >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len}: must be >= 2")
        if self.max_batch_tokens < self.max_slots:
            # Every running request must be able to decode one token in every iteration.
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} must be >= max_slots={self.max_slots}")
        if self.prompt_first_iterations < 0 or self.prompt_first_tokens < 1:
            raise ValueError(
                f"prompt_first_iterations={self.prompt_first_iterations}, prompt_first_tokens="
                f"{self.prompt_first_tokens}: must be >= 0 and >= 1"
            )
        if not 0 <= self.embed_share <= 1e6:
            raise ValueError(f"embed_share={self.embed_share}: must be a share >= 0")
        if not 0 <= self.prefix_cache_mib < 2**30:
            raise ValueError(f"prefix_cache_mib={self.prefix_cache_mib}: must be a size in MiB (0 turns it off)")
        kv_kinds(self.kv_dtype)  # (ValueError naming the choices)
        if not 0 < self.prefix_cache_disk_mib < 2**40:
            raise ValueError(f"prefix_cache_disk_mib={self.prefix_cache_disk_mib}: must be a size in MiB above 0")
        if self.speculate is not None and not 0 <= self.speculate <= 64 or not 1 <= self.speculate_ngram <= 64:
            raise ValueError(
                f"speculate={self.speculate}, speculate_ngram={self.speculate_ngram}: draft tokens must "
                f"be in [0, 64] (0: off), the n-gram in [1, 64]"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads}: must be >= 1")
