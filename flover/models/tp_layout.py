"""Which slice of every weight a tensor-parallel rank holds (Megatron-style).

Attention heads and MLP columns (each expert's too) are split evenly; kv heads are split when there
are at least as many as ranks, and replicated (each rank keeps the one its query heads use) when
there are fewer.
The vocabulary is split in equal padded blocks: rank r owns ids [r * V_r, (r + 1) * V_r).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flover.models.model_config import ModelConfig


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _kv_split(kv: int, rank: int, size: int) -> tuple[int, int]:
    """(this rank's kv heads, the first of them): split, or replicated where fewer than ranks."""
    if kv >= size and kv % size:
        raise ValueError(f"tensor parallelism over {size} ranks: num_key_value_heads={kv} is not divisible by {size}")
    if kv < size and size % kv:
        raise ValueError(
            f"tensor parallelism over {size} ranks: {kv} kv heads cannot be shared evenly "
            f"(the rank count must be a multiple of {kv})"
        )
    local = max(1, kv // size)
    return local, rank * kv // size if kv < size else rank * local


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    heads: int  # query heads on this rank
    head_start: int
    kv_heads: int  # kv heads on this rank
    kv_head_start: int
    intermediate: int
    intermediate_start: int
    vocab: int  # padded rows per rank
    vocab_start: int
    vocab_total: int
    expert_intermediate: int = 0  # each expert's MLP columns on this rank (mixtures of experts)
    expert_intermediate_start: int = 0

    @property
    def vocab_real(self) -> int:
        """Rows of this rank's block that exist in the checkpoint (the last block may be short)."""
        return max(0, min(self.vocab, self.vocab_total - self.vocab_start))

    def with_kv_heads(self, kv: int) -> "TPLayout":
        """This layout for layers with `kv` kv heads of their own (Gemma 4's full-attention layers)."""
        kv_local, kv_start = _kv_split(kv, self.rank, self.size)
        return dataclasses.replace(self, kv_heads=kv_local, kv_head_start=kv_start)

    @classmethod
    def build(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> "TPLayout":
        h, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        if h % size:
            raise ValueError(
                f"tensor parallelism over {size} ranks: num_attention_heads={h} is not divisible "
                f"by {size}; use -np in {{{_divisors(h)}}}"
            )
        kv_local, kv_start = _kv_split(kv, rank, size)
        if cfg.global_kv_heads:  # (Gemma 4) the full-attention layers' own count must split too
            _kv_split(cfg.global_kv_heads, rank, size)
        if inter % size:
            raise ValueError(
                f"tensor parallelism over {size} ranks: intermediate_size={inter} is not divisible by {size}"
            )
        expert_inter = cfg.moe.intermediate if cfg.moe is not None else 0
        if expert_inter % size:
            raise ValueError(
                f"tensor parallelism over {size} ranks: each expert's intermediate size {expert_inter} "
                f"is not divisible by {size}"
            )
        vocab = -(-cfg.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            heads=h // size,
            head_start=rank * (h // size),
            kv_heads=kv_local,
            kv_head_start=kv_start,
            intermediate=inter // size,
            intermediate_start=rank * (inter // size),
            vocab=vocab,
            vocab_start=rank * vocab,
            vocab_total=cfg.vocab_size,
            expert_intermediate=expert_inter // size,
            expert_intermediate_start=rank * (expert_inter // size),
        )
