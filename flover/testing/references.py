"""What the reference checks need of transformers beyond loading a model (tests, scripts/check_family.py)."""

from __future__ import annotations


def widened_delta_rule(dtype):
    """transformers' Gated DeltaNet functions compute in float32 whatever the model's dtype: for a
    float64 reference, the same functions (their code, unchanged) with float32 read as float64;
    the float32 / 16-bit references stay as they are. A context manager."""
    import contextlib
    import inspect
    import types

    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    class Widened:
        def __getattr__(self, name):
            return torch.float64 if name == "float32" else getattr(torch, name)

    @contextlib.contextmanager
    def patched():
        saved = []
        for module in (modeling_qwen3_5, modeling_qwen3_5_moe):
            for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
                f = inspect.unwrap(getattr(module, name))
                wide = types.FunctionType(f.__code__, {**f.__globals__, "torch": Widened()}, name, f.__defaults__)
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wide)
        try:
            yield
        finally:
            for module, name, f in saved:
                setattr(module, name, f)

    return patched() if dtype == torch.float64 else contextlib.nullcontext()
