"""Small random checkpoints made with transformers itself (fixed seed), once per test session."""

from __future__ import annotations

import pytest

from flover.testing.tiny_model import make_tiny_model, write_gguf
from tests.helpers import GGUF_MIX, TEST_PRESET, VARIANTS


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """make_model(variant) -> checkpoint directory (made once per session)."""
    made: dict[str, str] = {}

    def make(variant: str) -> str:
        if variant not in made:
            arch, overrides, *preset = VARIANTS[variant]
            out = tmp_path_factory.mktemp(variant)
            make_tiny_model(arch, {**TEST_PRESET, **(preset[0] if preset else {})}, out, **overrides)
            made[variant] = str(out)
        return made[variant]

    return make


@pytest.fixture(scope="session")
def make_gguf_mix(make_model, tmp_path_factory):
    """make_gguf_mix(embedding type) -> a GGUF file of the llama-256 test model whose projections
    mix the block types of GGUF_MIX (K-quants as random blocks), its tied embedding (the head) in
    that type."""
    made: dict[str, str] = {}

    def make(embedding: str = "Q6_K") -> str:
        if embedding not in made:
            out = tmp_path_factory.mktemp("gguf-mix") / f"mix-{embedding}.gguf"
            types = {**GGUF_MIX, "token_embd.weight": embedding}
            made[embedding] = str(write_gguf(make_model("llama-256"), out, "Q4_K", types=types))
        return made[embedding]

    return make


@pytest.fixture(scope="session")
def gguf_mix(make_gguf_mix) -> str:
    return make_gguf_mix()


@pytest.fixture(scope="session")
def llama_dir(make_model) -> str:
    return make_model("llama")


@pytest.fixture
def server(llama_dir):
    """A real `flover serve` on the llama test model (8 slots), killed after the test."""
    import signal

    from tests.helpers import Server

    srv = Server(llama_dir, "--max-slots", "8")
    yield srv
    srv.stop(signal.SIGKILL)
