"""Decode iterations replayed from CUDA graphs, one graph per (rows, keys) bucket.

On a GPU a small model's eager decode iteration is launch-bound: every layer issues ~15 kernels,
each costing more host time than GPU time (SmolLM2-135M on an H100: 23 ms per eager iteration,
almost all of it launches). A decode-only iteration has a static shape once its row count and its
attention length are rounded up to buckets, so the whole forward is captured once per bucket at
start-up and replayed with one launch.

Padding rows (past the iteration's real ones) decode token 0 at position 0 with one visible key
and write their K/V into a scratch slot past the last real one (`SlotBuffer(scratch_slots=1)`),
so they never touch a live sequence; their logits are dropped.

Only decode-only iterations whose decode slots are [0, n) take this path (the steady state
between arrivals); anything with a prefill chunk runs eagerly, as does tensor parallelism.
Without CUDA (`capture=False`, used by the CPU tests) the same static, padded batches run eagerly:
the bucketing and padding are then tested on any machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flover.models.attention import ForwardBatch
from flover.runner.kv_buffer import SlotBuffer

MIN_KEYS_BUCKET = 64


def buckets(limit: int, first: int = 1) -> list[int]:
    """Powers of two from `first` below `limit`, then `limit` itself: [1, 2, 4, ..., limit]."""
    sizes, size = [], first
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: run the static batch eagerly
    logits: torch.Tensor | None  # the graph's output buffer [rows, vocab block]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, buffer: SlotBuffer, capture: bool = True):
        """`buffer`: the slot buffer, made with a scratch slot. Rows go up to its slots, keys up to
        the positions it allocates per slot."""
        assert buffer.scratch_slot is not None, "padding rows need the buffer's scratch slot"
        self.model, self.kv, self.scratch_slot = model, buffer.layers, buffer.scratch_slot
        self.row_buckets = buckets(buffer.max_slots)
        self.key_buckets = buckets(buffer.max_seq_len, min(MIN_KEYS_BUCKET, buffer.max_seq_len))
        rows = self.row_buckets[-1]
        with torch.inference_mode():  # the engine steps in inference mode: its buffers must be inference tensors
            long = dict(dtype=torch.int64, device=buffer.device)
            self.input_ids = torch.zeros(rows, **long)
            self.positions = torch.zeros(rows, **long)
            self.write_slots = torch.full((rows,), self.scratch_slot, **long)
            self.span_lens = torch.ones(rows, **long)
            self.sample_rows = torch.arange(rows, **long)
            start = time.perf_counter()
            pool = torch.cuda.graph_pool_handle() if capture else None
            self._captured: dict[tuple[int, int], _Captured] = {}
            for r in reversed(self.row_buckets):  # largest first: later graphs reuse its pool memory
                for k in reversed(self.key_buckets):
                    self._captured[r, k] = self._capture(r, k, pool)
            self.capture_s = time.perf_counter() - start
        self.replays = 0  # iterations that ran here (stats, tests)
        self.padding_rows = 0  # rows they computed beyond the real ones

    @property
    def count(self) -> int:
        return len(self._captured)

    def _static_batch(self, rows: int, keys: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:rows],
            positions=self.positions[:rows],
            write_slots=self.write_slots[:rows],
            num_decode=rows,
            decode_span=rows,
            decode_rows=None,
            span_lens=self.span_lens[:rows],
            max_decode_len=keys,
            prefills=[],
            sample_rows=self.sample_rows[:rows],
        )

    def _capture(self, rows: int, keys: int, pool) -> _Captured:
        if pool is None:
            return _Captured(None, None)
        # Every row writes the scratch slot while capturing (the buffers' initial values). Each
        # run gets a fresh batch: a batch caches its attention mask, which must be captured.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: cuBLAS handles, workspaces
            self.model(self._static_batch(rows, keys), self.kv)
        torch.cuda.current_stream().wait_stream(side)
        batch = self._static_batch(rows, keys)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model(batch, self.kv)
        return _Captured(graph, logits)

    def run(self, batch: ForwardBatch, greedy: bool = False) -> torch.Tensor | None:
        """Logits [n, vocab block] of a decode-only iteration over slots [0, n), or None when the
        iteration has another shape (the caller then runs it eagerly). The result is a view of a
        buffer that the next replay overwrites. (`greedy`: the backends' common signature.)"""
        n = batch.num_decode
        if (
            batch.prefills
            or batch.decode_rows is not None
            or n == 0
            or n > self.row_buckets[-1]
            or batch.max_decode_len > self.key_buckets[-1]
        ):
            return None
        rows = next(r for r in self.row_buckets if r >= n)
        keys = next(k for k in self.key_buckets if k >= batch.max_decode_len)
        self.input_ids[:n] = batch.input_ids
        self.positions[:n] = batch.positions
        self.write_slots[:n] = batch.write_slots
        self.span_lens[:n] = batch.span_lens
        if n < rows:  # padding rows: token 0 at position 0, one key, written to the scratch slot
            self.input_ids[n:rows] = 0
            self.positions[n:rows] = 0
            self.write_slots[n:rows] = self.scratch_slot
            self.span_lens[n:rows] = 1
        self.replays += 1
        self.padding_rows += rows - n
        captured = self._captured[rows, keys]
        if captured.graph is None:
            return self.model(self._static_batch(rows, keys), self.kv)[:n]
        captured.graph.replay()
        return captured.logits[:n]
