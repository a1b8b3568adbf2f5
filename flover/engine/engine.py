"""The temporal-fusion engine. `Engine.step()` is one iteration in three calls and the text:

  plan = scheduler.schedule()         retire finished requests, compact the slots (two-step
                                      shuffle), admit waiting requests FCFS, choose the tokens
  result = runner.execute(plan)       the copies, ONE fused forward over every token of the
                                      iteration, sampling each row with its own parameters
  updates = scheduler.update(...)     append the tokens; stop ids and lengths end requests
  outputs.emit(updates)               text, stop strings, what callers see

`LLM` is the offline API on top: `LLM(model_dir).generate(prompts, params)`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from flover.config import RANK, EngineConfig, SamplingParams, kv_kinds, threads_per_rank
from flover.engine.intake import Intake
from flover.engine.interface import EngineStats, ServingEngine
from flover.engine.output import OutputProcessor
from flover.engine.prefix_cache import BLOCK_TOKENS, PrefixCache
from flover.engine.prefix_disk import PrefixDisk, checkpoint_digest, fingerprint
from flover.engine.scheduler import PromptFirst, Scheduler
from flover.engine.settings import resolve_config, resolve_max_seq_len
from flover.engine.speculation import DEFAULT_DRAFT_TOKENS, Speculation
from flover.models import CheckpointError, file_quantization, open_checkpoint
from flover.models.pooling import Pooling, chosen_pooling, cosine, pair_kind
from flover.models.stage_layout import StageLayout
from flover.models.tokenizer import Tokenizer, load_tokenizer
from flover.models.tp_layout import TPLayout
from flover.parallel.channel import IntakeChannel
from flover.parallel.comm import Communicator
from flover.parallel.intake_events import AddEvent
from flover.parallel.launch import local_ranks
from flover.parallel.pipeline import StageLink
from flover.request import EmbedParams, Request, RequestInput, RequestOutput, StepResult
from flover.runner.build import RankSetup, build_runner, kv_bytes_per_position, recurrent_layout
from flover.runner.cuda_graphs import DecodeGraphs
from flover.runner.kv_buffer import SlotBuffer
from flover.runner.kv_window import WindowedKV
from flover.runner.pipeline import InFlight
from flover.runner.pooling import DenseStack

if TYPE_CHECKING:  # a type only: the runner holds it
    from flover.native.forward import NativeForward

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


ENCODER_BATCH_TOKENS = 2048  # an embeddings-only model's token budget of an iteration, at least


class Engine(ServingEngine):
    """One persistent inference instance: model weights, the slot buffer and the scheduler."""

    def __init__(self, config: EngineConfig, comm: Communicator | None = None, pipe: StageLink | None = None):
        """`comm`: the tensor-parallel communicator when this is one rank of several (rank 0
        leads: it alone takes requests and samples; the others follow its step plans).
        `pipe`: this rank's place among pipeline stages (--pp; `comm` is then its stage's): the
        group's rank 0 leads, with up to one plan in flight per stage (runner/pipeline.py)."""
        config.validate()
        checkpoint = open_checkpoint(config.model)  # a Hugging Face directory or a GGUF file
        self.model_config = cfg = checkpoint.model_config()
        asked = config.quantization
        self.config = config = resolve_config(config, cfg, file_quantization(checkpoint))
        if asked == "auto" and config.quantization != "none":
            why = "--quantization none dequantizes them"
            types = "/".join(sorted(checkpoint.projection_types()))
            log.info("weights: the file's %s projections keep their codes (%s; %s)", types, config.quantization, why)
        tp_comm = comm if comm is not None and comm.size > 1 else None
        self.pipe = pipe
        self.comm = pipe.group if pipe is not None else tp_comm  # every rank of the engine
        self.is_leader = (tp_comm is None or tp_comm.rank == 0) and (pipe is None or pipe.is_leader)
        self.groups = 1
        ranks = self.comm.size if self.comm else 1
        # the node's ranks share its cores
        torch.set_num_threads(config.num_threads or threads_per_rank(local_ranks() or ranks))
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.tp = TPLayout.build(cfg, tp_comm.rank if tp_comm else 0, tp_comm.size if tp_comm else 1)
        self.stage = StageLayout.build(cfg, pipe.place.stage, pipe.place.stages) if pipe else None
        max_seq_len = resolve_max_seq_len(config, cfg, checkpoint.default_max_tokens())
        encoder_budget = max(max_seq_len, ENCODER_BATCH_TOKENS)
        if cfg.embeds_only and config.max_batch_tokens < encoder_budget:
            # an encoder's input comes whole; with no decode rows to keep short, iterations of
            # many inputs go faster (docs/embeddings.md, "Beside chats")
            self.config = config = dataclasses.replace(config, max_batch_tokens=encoder_budget)
        self.tokenizer, self.intake = self._intake(checkpoint, max_seq_len)
        prefix_blocks, window, snapshots = self._kv_plan(max_seq_len)
        if pipe is not None and self.is_leader:
            log.info(
                "pipeline: %d stages of %d rank(s), layers %s (the first stage also the embedding and head)",
                pipe.place.stages,
                pipe.place.tp,
                ", ".join(f"{a}-{b - 1}" for a, b in StageLayout.ranges(cfg, pipe.place.stages)),
            )
        self.runner = self._build_runner(checkpoint, max_seq_len, prefix_blocks, window, tp_comm, snapshots)
        self.pooling = self._pooling(config, checkpoint)  # embeddings (None: it makes none)
        self.outputs = OutputProcessor(self.tokenizer, on_fail=self._tell_followers_failed)
        self.prefix_cache = self._prefix_cache(checkpoint, prefix_blocks, window, snapshots)
        self.scheduler = Scheduler(
            config.max_slots,
            config.max_batch_tokens,
            self.prefix_cache,
            PromptFirst(config.prompt_first_iterations, config.prompt_first_tokens),
            self._speculation(self.runner.native, self.runner.graphs),
            window,
            depth=pipe.place.stages if pipe is not None else 1,
            whole_prompts=cfg.embeds_only,
            embed_share=config.embed_share,
        )
        # TP: the leader's intake reaches every rank's scheduler (pipeline stages: the leader's plans do)
        self.channel = IntakeChannel(tp_comm) if tp_comm is not None and pipe is None else None
        self._start_counters()

    def _build_runner(self, checkpoint, max_seq_len: int, prefix_blocks: int, window, tp_comm, snapshots: int):
        setup = RankSetup(
            self.config,
            self.model_config,
            self.tp,
            self.dtype,
            self.device,
            max_seq_len,
            prefix_blocks,
            BLOCK_TOKENS,
            tp_comm,
            self.is_leader,
            window,
            self.stage,
            self.pipe,
            snapshots,
        )
        return build_runner(checkpoint, setup)

    def _start_counters(self) -> None:
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs of requests cancelled between steps
        self._flights: deque[InFlight] = deque()  # pipeline stages: plans started, not finished
        self.iterations = 0
        self.last_step_tokens = 0  # rows of the last iteration's token matrix (stats, benchmarks)
        self._timed: deque[tuple[float, int]] = deque(maxlen=256)  # (seconds, rows) of recent iterations
        self.draft_tokens = self.accepted_tokens = 0  # speculation: rows of draft tokens, and those accepted

    def _intake(self, checkpoint, max_seq_len: int) -> tuple[Tokenizer | None, Intake]:
        """The checkpoint's tokenizer (None: token ids only) and the intake that checks requests."""
        config, cfg = self.config, self.model_config
        tokenizer = load_tokenizer(checkpoint)
        if tokenizer is not None:
            tokenizer.set_template_limits(config.template_limits)
        # new grammars are tried in a child first (a data-parallel group's leader: not, prepare_grammars)
        intake = Intake(tokenizer, cfg, max_seq_len, config.grammar_limits, checks_grammars=self.is_leader)
        if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size and self.is_leader:
            log.warning(
                "the tokenizer knows %d ids, the model %d: a text whose tokens fall outside the model's "
                "vocabulary is refused",
                tokenizer.vocab_size,
                cfg.vocab_size,
            )
        return tokenizer, intake

    def _kv_plan(self, max_seq_len: int) -> tuple[int, WindowedKV | None, int]:
        """(the prefix cache's blocks, the sliding-window layers' bound, the recurrent layers'
        state snapshots). Per rank; the same counts on every rank (heads split evenly), which keeps
        their prefix indexes making the same decisions (docs/prefix_cache.md)."""
        config, cfg = self.config, self.model_config
        if config.prefix_cache_dir is not None and self.comm is not None:
            raise ValueError(
                "--prefix-cache-dir: one rank only (tensor or pipeline parallel ranks would have to agree "
                "on every block read from disk); data-parallel groups of one rank each may share a directory"
            )
        if cfg.embeds_only:  # (no KV kept after an input: nothing to cache; whole inputs: no window)
            return 0, None, 0
        self._check_kv_dtype()
        block_bytes = kv_bytes_per_position(cfg, self.tp, self.dtype, kv_kinds(config.kv_dtype)) * BLOCK_TOKENS
        budget = config.prefix_cache_mib * 2**20
        snapshots = 0
        if cfg.linear_attention is not None and budget:
            budget, snapshots = self._snapshot_plan(budget)
        prefix_blocks = int(budget // block_bytes) if budget else 0
        if config.full_window_kv:
            return prefix_blocks, None, snapshots
        window = WindowedKV.plan(cfg.sliding_windows, max_seq_len, config.max_batch_tokens, BLOCK_TOKENS)
        return prefix_blocks, window, snapshots

    def _check_kv_dtype(self) -> None:
        """--kv-dtype's blocks: 32 values of one head, on the CPU (ValueError otherwise)."""
        config, cfg = self.config, self.model_config
        if kv_kinds(config.kv_dtype) is None:
            return
        if self.device.type != "cpu":
            raise ValueError(f"--kv-dtype {config.kv_dtype}: KV codes are read by the CPU's native step only")
        dims = {cfg.layer_head_dim(n) for n in cfg.kv_layers()}
        if any(d % 32 for d in dims):
            raise ValueError(
                f"--kv-dtype {config.kv_dtype}: blocks of 32 values of one head, and this model's heads "
                f"have {', '.join(map(str, sorted(dims)))} dims"
            )

    def _snapshot_plan(self, budget: float) -> tuple[float, int]:
        """Recurrent layers keep no KV to rebuild their state from: half the prefix cache's bytes
        go to snapshots of their state (one a cached block edge worth resuming at), half to the
        other layers' KV blocks. (the KV blocks' bytes, the snapshots); (0, 0): the cache is off."""
        cfg = self.model_config
        one = recurrent_layout(cfg, self.tp, self.dtype, range(cfg.num_layers)).slot_bytes(self.dtype)
        snapshots = int(budget / 2 // one)
        why = "pipeline stages" if self.pipe is not None else "a snapshot is larger than half" if snapshots < 2 else ""
        if why:
            if self.is_leader:
                log.info("prefix cache off: the recurrent layers' state snapshots and %s", why)
            return 0, 0
        if self.is_leader:
            log.info(
                "prefix cache: %d state snapshots of %.1f MiB (the recurrent layers' state at a block edge)",
                snapshots,
                one / 2**20,
            )
        return budget - snapshots * one, snapshots

    def _prefix_cache(self, checkpoint, blocks: int, window: WindowedKV | None, snapshots: int) -> PrefixCache | None:
        """The prefix cache (None: off), with its directory when --prefix-cache-dir names one."""
        config, buffer = self.config, self.runner.buffer
        if not blocks:
            if config.prefix_cache_dir is not None:
                log.warning("--prefix-cache-dir %s: not used, the prefix cache is off", config.prefix_cache_dir)
            return None
        disk = None
        if config.prefix_cache_dir is not None:
            disk = PrefixDisk(
                config.prefix_cache_dir,
                self._disk_fingerprint(checkpoint, window),
                int(config.prefix_cache_disk_mib * 2**20),
            )
            log.info(
                "prefix cache on disk: %s, %d files (%.1f MiB of %.0f), written as blocks are stored",
                disk.dir,
                disk.files,
                disk.nbytes / 2**20,
                config.prefix_cache_disk_mib,
            )
        return PrefixCache(blocks, BLOCK_TOKENS, window, snapshots, disk, (buffer.block_nbytes, buffer.snapshot_nbytes))

    def _disk_fingerprint(self, checkpoint, window: WindowedKV | None) -> bytes:
        """What a cached block's bytes depend on: the model's files, the dtype and quantization,
        the build that computes them (its kernels) and the pool's and snapshots' layout."""
        buffer, native = self.runner.buffer, self.runner.native
        pools = [
            (g.windowed, str(g.pool.dtype), tuple(g.pool.shape[:2]), tuple(g.pool.shape[3:])) for g in buffer.groups
        ]
        states = [
            (str(t.dtype), tuple(t.shape[2:])) for t in (buffer.snapshot_conv, buffer.snapshot_state) if t is not None
        ]
        return fingerprint(
            [
                version("flover"),
                checkpoint_digest(checkpoint.path),
                self.config.dtype,
                self.config.kv_dtype,
                self.config.quantization,
                Path(native.lib._name).name if native is not None else f"torch {torch.__version__}",
                pools,
                states,
                (window.capacity, sorted(window.layers)) if window is not None else None,
                self.model_config,
            ]
        )

    def _persist(self) -> None:
        """The blocks (and snapshots) stored by the plan just run go to disk (their rows hold them now)."""
        cache = self.prefix_cache
        if cache is None or cache.disk is None:
            return
        writes, states = cache.take_writes()
        for w in writes:
            cache.disk.write_block(w.key, w.previous, w.tokens, w.whole, self.runner.buffer.block_bytes(w.row))
        for row, key in states:
            cache.disk.write_state(key, self.runner.buffer.snapshot_bytes(row))

    def flush_prefix_cache(self) -> None:
        """With --prefix-cache-dir: the requests that finished are stored (as the next iteration
        would) and every stored block is on disk when this returns."""
        cache = self.prefix_cache
        if cache is None or cache.disk is None:
            return
        self.runner.execute(self.scheduler.release())
        self._persist()
        cache.disk.flush()

    def _speculation(self, native: NativeForward | None, graphs: DecodeGraphs | None) -> Speculation:
        """The drafts' settings, or off where rows cannot carry them (said when they were asked
        for). Under TP every rank decides alike: drafts need the native step on all of them."""
        config = self.config
        if config.speculate == 0:
            return Speculation()
        if self.model_config.linear_attention is not None:  # (every rank alike: the model's)
            # a draft's rejected tokens would stay in the recurrent layers' state (no rollback yet)
            if config.speculate is not None and self.is_leader:
                log.warning("speculation off: recurrent (Gated DeltaNet) layers cannot take back rejected drafts")
            return Speculation()
        why = "the native step is off" if native is None else "CUDA graphs" if graphs is not None else None
        if self.comm is not None:
            ready = torch.tensor([0.0 if why else 1.0], device=self.device)
            self.comm.all_reduce(ready)
            if why is None and ready.item() < self.comm.size:
                why = "the native step is off on another rank"
        if why is not None:
            if config.speculate is not None:
                log.warning("speculation off: draft rows need the native CPU step (%s)", why)
            return Speculation()
        tokens = DEFAULT_DRAFT_TOKENS if config.speculate is None else config.speculate
        log.info(
            "speculation: greedy requests draft up to %d tokens by prompt lookup (%d-grams; --speculate 0: off)",
            tokens,
            config.speculate_ngram,
        )
        return Speculation(tokens, config.speculate_ngram)

    # -- intake ---------------------------------------------------------------------------
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; it joins the running batch at the next iteration. Raises
        ValueError (and changes nothing) when the request cannot be served."""
        return self.enqueue(self.make_request(RequestInput(prompt, params, request_id)))

    def _pooling(self, config: EngineConfig, checkpoint) -> Pooling | None:
        """How embedding requests pool (and whether the model is a reranker, which takes pairs)."""
        if config.pooling == RANK and self.model_config.embeds_only:
            raise CheckpointError(f"--pooling rank: {self.model_config.architecture} has no LM head to score with")
        pooling = chosen_pooling(config.pooling, checkpoint.pooling(), self.tokenizer.token_id)
        self.runner.pooling = pooling
        self.intake.pairs = pair_kind(
            pooling, self.model_config.vocab_size, self.tokenizer.chat_template_source is not None
        )
        self.intake.pair_template = pooling.pair_template if pooling is not None else None
        self.intake.scores_only = pooling is not None and pooling.scores_only
        if self.intake.pairs == "template" and self.intake.pair_template is None:
            self.intake.check_pair_template()  # (the chat template renders the pairs)
        if pooling is not None and pooling.dense:
            self.runner.dense = DenseStack(pooling, self.model_config.hidden_size)
            self.intake.vector_width = self.runner.dense.width
        if pooling is not None and self.is_leader:
            normed = "normalized" if pooling.normalize else "not normalized"
            kind = f", a reranker ({self.intake.pairs})" if self.intake.pairs else ""
            log.info("embeddings: %s pooling, %s%s (%s)", pooling.mode, normed, kind, pooling.source)
        return pooling

    def make_request(self, given: RequestInput) -> Request:
        """Validate and tokenize (Intake.build: ValueError naming what is wrong), under an id not
        in flight (the next free number if None). Queues nothing."""
        request_id = str(next(self._ids)) if given.request_id is None else str(given.request_id)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if given.embed is not None and self.embeddings_refused is not None:
            raise ValueError(self.embeddings_refused)
        if given.embed is None and self.model_config.embeds_only:
            raise ValueError(f"{self.model_config.architecture} is a text encoder: it makes embeddings, not text")
        if given.embed is None and self.intake.scores_only:
            raise ValueError(
                "this model is a reranker whose files hold no LM head (a reranker's GGUF file, a "
                "*ForSequenceClassification): it scores pairs"
            )
        return self.intake.build(request_id, given)

    @property
    def embeddings_refused(self) -> str | None:
        """Why this engine makes no embeddings (None: it makes them)."""
        if self.pooling is None:
            return (
                "this model makes no embeddings: its checkpoint names no pooling (a sentence-transformers "
                "modules.json, a GGUF pooling_type); serve it with --pooling mean|cls|last for a decoder's, "
                "--pooling rank to score pairs with it as a reranker"
            )
        if self.pipe is not None:
            return "embeddings run in one engine, not across pipeline stages (--pp)"
        if not hasattr(self.runner.model, "final_norm"):
            return f"{self.model_config.architecture} makes no embeddings"
        return None

    def enqueue(self, request: Request) -> str:
        self.scheduler.add(request)  # (refuses an id in flight)
        if self.channel is not None:
            r = request
            self.channel.added(AddEvent(r.request_id, r.prompt_token_ids, r.params, r.cache_salt, r.embed))
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its final output comes with the next step(). False if unknown/done."""
        request = self.scheduler.cancel(request_id, time.perf_counter())
        if request is None:
            return False
        if self.channel is not None:
            self.channel.cancelled(request_id)
        self._pending.append(self.outputs.output(request, []))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._pending) or bool(self._flights) or self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        """Requests in a slot, not finished (cheap: for loops that ask every iteration)."""
        return len(self.scheduler.running)

    @property
    def num_in_flight(self) -> int:
        """Requests queued or running (a finished one leaves at the next step)."""
        return len(self.scheduler.requests)

    def can_accept(self, max_waiting: int) -> bool:
        """Whether a request queued now would wait behind fewer than `max_waiting` others."""
        return len(self.scheduler.waiting) < max_waiting

    def stats(self) -> EngineStats:
        running = self.scheduler.running  # finished requests still in a slot until the next step do not count
        kv_tokens = sum(r.kv_len for r in running)
        buffer, cache = self.runner.buffer, self.prefix_cache
        return EngineStats(
            running=len(running),
            waiting=len(self.scheduler.waiting),
            slots_total=self.config.max_slots,
            kv_bytes=buffer.nbytes,
            kv_tokens=kv_tokens,
            kv_use=kv_tokens / (self.config.max_slots * self.max_seq_len),
            iterations=self.iterations,
            last_step_tokens=self.last_step_tokens,
            shuffle_moves=buffer.moves_done,
            shuffle_bytes=buffer.bytes_moved,
            shuffle_seconds=buffer.move_seconds,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            prefix_cache=None
            if cache is None
            else {
                **dataclasses.asdict(cache.stats),
                "blocks_used": cache.used_blocks,
                "blocks_total": cache.num_blocks,
                "block_tokens": cache.block_tokens,
                "block_bytes": buffer.block_nbytes,
                **(self._disk_stats(cache.disk) if cache.disk is not None else {}),
            },
            native_kernels=self.runner.native.kernels if self.runner.native is not None else None,
            expert_load=self.runner.expert_load(),
            pipeline=self.runner.pipeline_stats(len(self._flights)) if self.pipe is not None else None,
            kv_bytes_per_token=kv_bytes_per_position(
                self.model_config, self.tp, self.dtype, kv_kinds(self.config.kv_dtype)
            ),
        )

    @staticmethod
    def _disk_stats(disk: PrefixDisk) -> dict:
        return {
            "disk_files": disk.files,
            "disk_bytes": disk.nbytes,
            **{f"disk_{k}": v for k, v in dataclasses.asdict(disk.stats).items()},
        }

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len, vocab] for every position of `token_ids` (teacher forcing), through the
        same forward pass as step(), in a slot above the live range: running requests are not
        disturbed. For evaluation and reference checks."""
        if self.pipe is not None:
            raise ValueError("scoring runs in one engine, not across pipeline stages (--pp)")
        ids, _ = self.intake.tokenize(token_ids)
        if self.scheduler.num_live >= self.config.max_slots and self.comm is None:
            self.runner.execute(self.scheduler.release())  # requests that finished still hold their slots
            self._persist()
        slot = self.scheduler.num_live
        if slot >= self.config.max_slots or len(ids) > self.max_seq_len:
            raise ValueError("no free slot, or the sequence is longer than max_seq_len")
        return self.runner.score(ids, slot)

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def buffer(self) -> SlotBuffer:
        return self.runner.buffer

    # -- tensor parallelism: the leader's intake reaches every rank --------------------------
    def _exchange_plan(self) -> bool:
        """Leader: send the intake since the last iteration. Follower: apply the leader's, so
        that its scheduler makes the leader's decisions. False once the leader has shut down."""
        message = self.channel.exchange(self.scheduler.iteration_cost.knee)
        if message is not None:
            self.scheduler.iteration_cost.leader_knee = message.knee
            for event in message.events:
                if isinstance(event, AddEvent):
                    self.enqueue(
                        self.make_request(
                            RequestInput(
                                event.token_ids,
                                None if event.embed else event.params,  # (an embedding's are the intake's)
                                event.request_id,
                                cache_salt=event.cache_salt,
                                embed=event.embed,
                            )
                        )
                    )
                else:
                    self.abort(event)
            self._pending.clear()  # only the leader reports
        return not self.channel.closed

    def follow(self) -> None:
        """A follower rank's whole life: run the leader's iterations until it shuts down."""
        assert not self.is_leader
        if self.pipe is not None:
            self.runner.follow()
            return
        while not self.channel.closed:
            self.step()

    def shutdown(self) -> None:
        """Leader: release the followers (their follow() returns). Requests in flight are dropped."""
        if self.channel is not None:
            self.channel.close()
        if self.pipe is not None and self.is_leader:
            self.runner.stop_followers()
        self.intake.close()
        if self.prefix_cache is not None and self.prefix_cache.disk is not None:
            self.flush_prefix_cache()
            self.prefix_cache.disk.close()

    def _tell_followers_failed(self, request_id: str) -> None:
        """A request failed on the leader alone: the followers retire it at the next boundary."""
        if self.channel is not None:
            self.channel.cancelled(request_id)

    # -- one iteration --------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: the scheduler plans it, the runner carries it out (one fused forward),
        the scheduler takes the result, and the text half turns it into outputs."""
        if self.pipe is not None:
            return self._pipeline_step()
        started = time.perf_counter()
        if self.channel is not None and not self._exchange_plan():
            return []
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        self._persist()
        updates = self.scheduler.update(plan, result, time.perf_counter())
        outputs += self.outputs.emit(updates, time.perf_counter())
        self._count(result, time.perf_counter() - started)
        return outputs

    def _pipeline_step(self) -> list[RequestOutput]:
        """Pipeline stages: plans are started (their first stage run) until one per stage is in
        flight or no request is free to take, then the oldest is finished (head, sampling, the
        scheduler's update, the text). With few requests one plan is in flight at a time."""
        outputs, self._pending = self._pending, []
        while len(self._flights) < self.scheduler.depth:
            flight = self.runner.start(self.scheduler.schedule())
            if flight is None:
                break
            self._flights.append(flight)
        if self._flights:
            flight = self._flights.popleft()
            result = self.runner.finish(flight)
            updates = self.scheduler.update(flight.plan, result, time.perf_counter())
            outputs += self.outputs.emit(updates, time.perf_counter())
            self._count(result, result.seconds)
        return outputs

    def _count(self, result: StepResult, seconds: float) -> None:
        if result.rows:
            self.iterations += 1
            self.last_step_tokens = result.rows
            self.draft_tokens += result.draft_rows
            self.accepted_tokens += sum(map(len, result.accepted.values()))
            self._timed.append((seconds, result.rows))

    def timed_iterations(self) -> list[tuple[float, int]]:
        """(seconds, rows) of each iteration that ran a forward since the last call (the serving
        metrics' histogram)."""
        timed = list(self._timed)
        self._timed.clear()
        return timed


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

    def generate(
        self,
        prompts: str | Sequence[int] | Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt through the engine (fused, as slots allow) and return the final
        outputs in prompt order. `params` is one SamplingParams for all or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return self._run([RequestInput(prompt, p) for prompt, p in zip(prompts, params)], "prompt")

    def embed(
        self,
        inputs: str | Sequence[int] | Iterable[str | Sequence[int]],
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[RequestOutput]:
        """Each input's vector (`.embedding`), pooled as the model says (models/pooling.py), in
        input order: the inputs ride in fused iterations as prompts do, and keep no KV after.
        `dimensions`: the first so many components; `truncate_prompt_tokens`: an input longer
        than max_seq_len keeps its first so many tokens (else it is refused)."""
        if isinstance(inputs, str) or (isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        embed = EmbedParams(dimensions, truncate_prompt_tokens)
        return self._run([RequestInput(text, embed=embed) for text in inputs], "input")

    def score(
        self, query: str, documents: str | Sequence[str], truncate_prompt_tokens: int | None = None
    ) -> list[float]:
        """Each document's relevance to `query`, in document order: a reranker's (cross-encoder's)
        score of the (query, document) pair, as sentence-transformers' CrossEncoder.predict gives
        it; an embedding model's cosine similarity of the two vectors. `truncate_prompt_tokens`:
        a longer pair loses the document's last tokens (a longer text its last tokens)."""
        documents = [documents] if isinstance(documents, str) else list(documents)
        pooling = self.engine.pooling
        if pooling is None or not pooling.classify:
            vectors = [o.embedding for o in self.embed([query, *documents], None, truncate_prompt_tokens)]
            return [cosine(vectors[0], v) for v in vectors[1:]]
        labels = pooling.scores or self.engine.model_config.num_labels
        if labels != 1:
            raise ValueError(f"score: this classifier has {labels} labels, not one score")
        return [o.embedding[0] for o in self.pair_outputs(query, documents, truncate_prompt_tokens)]

    def pair_outputs(
        self, query: str, documents: Sequence[str], truncate_prompt_tokens: int | None = None
    ) -> list[RequestOutput]:
        """A reranker's output for each (query, document) pair, in document order: `.embedding`
        holds its label scores (one for a reranker), activated as its checkpoint says."""
        given = [RequestInput(query, embed=EmbedParams(None, truncate_prompt_tokens, d)) for d in documents]
        return self._run(given, "document")

    def _run(self, given: list[RequestInput], what: str) -> list[RequestOutput]:
        """Every request validated before any is queued, then stepped until all are finished:
        their final outputs in the order given."""
        engine = self.engine
        requests = []
        for n, one in enumerate(given):
            try:
                requests.append(engine.make_request(one))
            except ValueError as e:
                raise type(e)(f"{what} {n}: {e}") from None  # (PromptTooLong stays one)
        ids = [engine.enqueue(r) for r in requests]
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        engine.flush_prefix_cache()  # (with a directory: these sequences' blocks are in it now)
        return [finals[i] for i in ids]
