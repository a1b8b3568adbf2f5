"""The sampler's filters and draw in C (sampling.c), around PyTorch's softmax: the tokens of
flover/runner/sampler.py's PyTorch path, bit for bit (docs/sampling.md), in three calls instead of
a few dozen tensor operations over [rows, vocab]."""

from __future__ import annotations

import ctypes

import torch

from flover.native.abi import SAMPLE_SCRATCH_BYTES_PER_TOKEN as SCRATCH_BYTES_PER_TOKEN  # per thread


class NativeSampler:
    """`sample` for float32 logits on CPU; the parameters are SamplingTensors' (one per row)."""

    # rows go through scale, softmax and draw a block at a time, each block in cache from one step
    # to the next (32 rows at once: ~1/4 slower at a 128k vocabulary, every step from memory);
    # a multiple of sampling.c's GROUP x 2 threads
    BLOCK_BYTES = 4 << 20

    def __init__(self, lib: ctypes.CDLL, threads: int):
        self.lib, self.threads = lib, threads
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._scaled = self._probs = torch.empty(0)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seed: torch.Tensor,
        counter: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [B, vocab] float32 (rows may be apart) -> token ids [B] int64; raises
        FloatingPointError for a sampled row holding NaN or +inf, or no finite value. `allowed`:
        [B, words] int32, structured output's bitmask (a clear bit: that token is -inf)."""
        rows, vocab = logits.shape
        assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1
        f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731  (no copies when they are already)
        i64 = lambda t: t.to(torch.int64).contiguous()  # noqa: E731
        temperature, top_k, top_p, min_p, seed, counter = (
            f32(temperature),
            i64(top_k),
            f32(top_p),
            f32(min_p),
            i64(seed),
            i64(counter),
        )
        block = self._buffers(rows, vocab)
        ids = torch.empty(rows, dtype=torch.int64)
        at = torch.empty(block, dtype=torch.int64)  # the block's row of each scaled row
        rows_of = (temperature, top_k, top_p, min_p, seed, counter)
        for first in range(0, rows, block):  # each call sees the block as its batch
            self._sample_block(logits, first, min(block, rows - first), rows_of, allowed, ids, at)
        return ids

    def _buffers(self, rows: int, vocab: int) -> int:
        """The scratch and the scaled rows' buffers large enough; the rows of one block."""
        need = self.threads * vocab * SCRATCH_BYTES_PER_TOKEN
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        block = min(rows, max(8, self.BLOCK_BYTES // (4 * vocab) // 8 * 8))
        if self._scaled.numel() < block * vocab:
            self._scaled, self._probs = torch.empty(block * vocab), torch.empty(block * vocab)
        return block

    def _sample_block(self, logits, first: int, size: int, rows_of: tuple, allowed, ids, at) -> None:
        """Rows [first, first + size): scaled and masked in C, PyTorch's softmax, drawn in C."""
        vocab = logits.shape[1]
        temperature, top_k, top_p, min_p, seed, counter = rows_of
        address = lambda t, first: t.data_ptr() + first * t.element_size()  # noqa: E731
        n = self.lib.flover_sample_scale(
            address(logits, first * logits.stride(0)),
            size,
            vocab,
            logits.stride(0),
            address(temperature, first),
            address(top_k, first),
            None if allowed is None else address(allowed, first * allowed.shape[1]),
            0 if allowed is None else allowed.shape[1],
            self._scaled.data_ptr(),
            at.data_ptr(),
            address(ids, first),
            self._scratch.data_ptr(),
            self.threads,
        )
        if n < 0:
            raise FloatingPointError(
                f"row {first - 1 - n}: the logits hold NaN or +inf, or no finite value: nothing to sample from"
            )
        if n:  # the definition's probabilities: PyTorch's softmax, into a buffer of our own
            probs = self._probs[: n * vocab].view(n, vocab)
            torch.ops.aten._softmax.out(self._scaled[: n * vocab].view(n, vocab), -1, False, out=probs)
            self.lib.flover_sample_draw(
                probs.data_ptr(),
                n,
                vocab,
                at.data_ptr(),
                address(top_p, first),
                address(min_p, first),
                address(seed, first),
                address(counter, first),
                address(ids, first),
                self._scratch.data_ptr(),
                self.threads,
            )
