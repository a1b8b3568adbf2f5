"""Small random checkpoints made with transformers itself (fixed seed), once per test session."""

from __future__ import annotations

import json

import pytest

from flover.testing.tiny_model import make_tiny_model

# Small enough that a whole reference comparison takes well under a second.
TEST_PRESET = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                   vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)

# name -> (arch, config overrides[, preset overrides]): every supported architecture and the
# features that vary.
VARIANTS = {
    "llama": ("llama", {}),
    "llama-mqa-bias-tied-llama3": ("llama", dict(
        num_key_value_heads=1, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral-window8": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", {}),
    "gptj": ("gptj", {}),
    # a vocabulary that does not split evenly over 2 or 4 ranks, 4 kv heads (split, not replicated)
    "llama-vocab509-kv4": ("llama", dict(num_key_value_heads=4), dict(vocab_size=509)),
    # head_dim 80 (not a multiple of 64) and 6 query heads sharing one kv head
    "llama-head80-group6": ("llama", dict(num_key_value_heads=1), dict(hidden_size=480, num_heads=6)),
}

PROMPTS = ["Hello the cat runs fast", "A", "数据 模型 over the river and far away 12345 " * 3,
           "one two three four five six seven eight nine ten"]


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


def rewrite_config(model_dir, **changes) -> None:
    path = f"{model_dir}/config.json"
    with open(path) as f:
        raw = json.load(f)
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        raw.pop(key)
    with open(path, "w") as f:
        json.dump(raw, f)


@pytest.fixture
def server(llama_dir):
    """A real `flover serve` on the llama test model (8 slots), killed after the test."""
    import signal

    from tests.test_daemon import Server

    srv = Server(llama_dir, "--max-slots", "8")
    yield srv
    srv.stop(signal.SIGKILL)
