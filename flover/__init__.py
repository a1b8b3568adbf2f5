"""flover: temporal-fusion inference for decoder-only transformer LLMs."""

from flover.config import EngineConfig, SamplingParams
from flover.engine import LLM, Engine
from flover.request import RequestOutput

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
