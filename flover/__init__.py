"""flover: temporal-fusion inference for decoder-only transformer LLMs."""

from flover.config import EngineConfig, SamplingParams
from flover.request import RequestOutput

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """The engine (and torch behind it) loads on first use: clients of a running daemon
    (`flover.client`, `flover run --connect`, the HTTP front) never pay for it."""
    if name in ("LLM", "Engine"):
        from flover import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'flover' has no attribute {name!r}")
