"""The machine's own limits, measured in the same run: memory bandwidth and matmul rate, and from
them the floor of one decode iteration of the model at a given batch size."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Roofline:
    bandwidth_gb_s: float  # bytes read per second streaming a 256 MiB tensor (what decode does to weights)
    matmul_gflop_s: float  # dense float32 2048^3 matmul
    weight_bytes: int
    params: int
    copy_gb_s: float = 0.0  # read + write bytes per second of a 256 MiB copy, for reference

    def floor_ms(self, batch: int) -> float:
        """One decode iteration can be no faster than reading every weight once, nor than doing
        its 2 x params x batch FLOPs."""
        return 1000 * max(
            self.weight_bytes / (self.bandwidth_gb_s * 1e9), 2 * self.params * batch / (self.matmul_gflop_s * 1e9)
        )

    def as_dict(self) -> dict:
        return asdict(self)


def _best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(weight_bytes: int, params: int, threads: int | None = None) -> Roofline:
    if threads:
        torch.set_num_threads(threads)
    src = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB, far beyond any cache
    src.fill_(1.0)
    dst = torch.empty_like(src)
    read = _best_of(lambda: src.sum())
    copy = _best_of(lambda: dst.copy_(src))
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    mm = _best_of(lambda: torch.mm(a, b))
    nbytes = src.numel() * 4
    return Roofline(
        bandwidth_gb_s=nbytes / read / 1e9,
        matmul_gflop_s=2 * 2048**3 / mm / 1e9,
        weight_bytes=weight_bytes,
        params=params,
        copy_gb_s=2 * nbytes / copy / 1e9,
    )


def model_size(model_dir: str) -> tuple[int, int]:
    """(bytes of the float32 weights a decode iteration reads, parameter count) from the checkpoint."""
    from flover.models import load_model_config

    cfg = load_model_config(model_dir)
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    per_layer = (
        h * (cfg.num_heads * d + 2 * cfg.num_kv_heads * d) + cfg.num_heads * d * h + (3 if cfg.gated_mlp else 2) * h * i
    )
    params = cfg.num_layers * per_layer + v * h  # + the LM head (the embedding lookup reads a few rows)
    return 4 * params, params
