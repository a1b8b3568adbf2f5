"""Small random checkpoints made with transformers itself (fixed seed), once per test session."""

from __future__ import annotations


import pytest

from flover.testing.tiny_model import make_tiny_model
from tests.helpers import TEST_PRESET, VARIANTS


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
