"""Small random checkpoints made with transformers itself (fixed seed), once per test session; the
tiers every test is marked with as it is collected."""

from __future__ import annotations

import inspect
import re

import pytest

from flover.testing.tiny_model import make_tiny_model, write_gguf
from tests.helpers import GGUF_MIX, TEST_PRESET, VARIANTS


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """make_model(variant) -> checkpoint directory (made once per session)."""
    made: dict[tuple, str] = {}

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

    def make(embedding: str = "Q6_K", mix: dict[str, str] = GGUF_MIX) -> str:
        key = (embedding, tuple(mix.items()))
        if key not in made:
            out = tmp_path_factory.mktemp("gguf-mix") / f"mix-{embedding}.gguf"
            types = {**mix, "token_embd.weight": embedding}
            made[key] = str(write_gguf(make_model("llama-256"), out, "Q4_K", types=types))
        return made[key]

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


# -- tiers ------------------------------------------------------------------------------------
# Each test is marked by what its source (and that of the fixtures and functions it calls) starts:
# `mpi` real mpirun jobs, `daemon` other processes (daemons, HTTP fronts, the command line,
# compilers, pip); `kernels` a native test on a kernel family other than the one this CPU runs by
# default; `slow` the in-process tests that take seconds each (SLOW_TESTS, by name). The fast
# tier is what is left: `scripts/test.sh --fast` (-m "not mpi and not daemon and not kernels and
# not slow").
MPI_SIGNS = re.compile(
    r"mpirun|MPIRUN|\branks=(?!1\b)\w|(flover_run_ok|flover_run_cmd|mpirun_cmd)\(\s*(?!1\b)\w|--tp\b|--dp\b|--pp\b"
)
PROCESS_SIGNS = re.compile(
    r"Server\(|\bserver\b|Popen|subprocess|flover_run|http_front|sys\.executable|\bpip\b"
    r"|build_library|load_library|qemu|\bcc\b"
)
SLOW_TESTS = re.compile(  # (by name: their reference runs, the real model, the paper suite, the largest vocabularies,
    # sentence-transformers' references)
    r"test_float64_greedy_generation_matches_transformers|test_logits_match_transformers\[.*float32"
    r"|test_native_step_gives_the_pytorch_logits|test_greedy_tokens_and_logits_equal_transformers_on_the_same_file"
    r"|smollm2|paper_suite|49152\]|128256\]|sentence_transformers"
)


def _sources(item, cache: dict) -> tuple[str, str]:
    """(the source of the test, the fixtures it uses and the functions of its module it calls;
    that and the source of the tests/helpers.py functions and classes these call), two calls deep."""
    from tests import helpers

    key = (item.function, tuple(item.fixturenames))
    if key in cache:
        return cache[key]

    def source(obj) -> str:
        try:
            return inspect.getsource(obj)
        except (OSError, TypeError):
            return ""

    own = source(item.function)
    defs = item._fixtureinfo.name2fixturedefs if hasattr(item, "_fixtureinfo") else {}
    own += "".join(source(d.func) for name in item.fixturenames for d in defs.get(name, ()))
    shared, seen = "", set()
    for _ in range(2):
        for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", own + shared)) - seen:
            seen.add(name)
            for module in (item.module, helpers):
                obj = getattr(module, name, None)
                if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
                    if module is helpers:
                        shared += source(obj)
                    else:
                        own += source(obj)
    cache[key] = own, own + shared
    return cache[key]


def pytest_collection_modifyitems(config, items):
    default_family, cache = None, {}
    for item in items:
        own, source = _sources(item, cache)
        if MPI_SIGNS.search(own):  # (a helper that can run mpirun is not a sign: its caller's ranks are)
            item.add_marker(pytest.mark.mpi)
        if PROCESS_SIGNS.search(source):
            item.add_marker(pytest.mark.daemon)
        family = getattr(item, "callspec", None) and item.callspec.params.get("kernel_family")
        if family is not None:
            if default_family is None:
                from flover.native.build import runnable_families

                default_family = runnable_families()[0]  # (the widest: what "auto" builds)
            if family != default_family:
                item.add_marker(pytest.mark.kernels)
        if SLOW_TESTS.search(item.name):
            item.add_marker(pytest.mark.slow)
