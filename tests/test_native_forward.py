"""The native step (flover/native/forward.py, native/*.c) against the PyTorch forward on the same
iteration state, for every Llama-family variant, in float32 and bfloat16, with every kernel
family this CPU can execute (each test runs once per family: simd.h's mappings, and AVX-512
BF16's dot products where the CPU has them)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import platform
import random
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flover.config import EngineConfig, SamplingParams
from flover.engine.engine import LLM, Engine
from flover.hardware import cpu_flags
from flover.models.attention import ForwardBatch, PrefillSpan
from flover.models.quant import Grid
from flover.native.abi import load_library
from flover.native.build import (
    KERNELS_ENV,
    X86_V3,
    X86_V4,
    NativeUnavailable,
    build_library,
    kernel_flags,
    runnable_families,
)
from flover.native.forward import argmax
from flover.testing.tiny_model import make_tiny_model, write_gguf
from tests.helpers import GGUF_LOW_BITS, TEST_PRESET, random_arrival_jobs, run_arrivals

FAMILIES = runnable_families()


@pytest.fixture(autouse=True, params=FAMILIES)
def kernel_family(request, monkeypatch) -> str:
    """Every test of this file once per kernel family (the engine builds the one the variable names)."""
    monkeypatch.setenv(KERNELS_ENV, request.param)
    return request.param


Compared = tuple[int, int, float, float, bool]  # decode rows, prompt rows, max |difference|, max |logit|, same argmax


def compare_on_random_arrivals(
    model_dir: str, dtype: str, seed: int = 0, quantization: str = "none", **options
) -> tuple[list[Compared], Engine]:
    """random_arrival_jobs (some scoring their prompts) into 6 slots, in iterations of up to 24
    tokens. Every iteration the native step takes is also run through the
    PyTorch model first, on the same KV state (the native step then rewrites the iteration's K/V
    itself, so that later iterations read its own cache; recurrent states are put back as they
    were before the native step runs)."""
    engine = Engine(
        EngineConfig(
            model_dir,
            dtype=dtype,
            max_slots=6,
            max_batch_tokens=24,
            max_seq_len=110,
            prompt_first_iterations=0,  # mixed iterations are what is compared
            speculate=0,  # draft rows: the PyTorch forward cannot run them
            quantization=quantization,
            keep_pytorch_weights=True,
            **options,
        )
    )
    runner, native = engine.runner, engine.runner.native
    assert native is not None, "the native step should be available on this machine (a C compiler, x86-64 Linux)"
    with torch.no_grad():  # random checkpoints have zero biases: make them count (both paths read these tensors)
        generator = torch.Generator().manual_seed(seed)
        for name, param in runner.model.named_parameters():
            if "bias" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    compared = []

    buffer = runner.buffer
    recurrent = [t for t in (buffer.conv, buffer.recurrent_state) if t is not None]  # (Qwen3.5's states)

    def forward(batch, rows=None):  # logits always (no greedy ids): they are what is compared
        before = [t.clone() for t in recurrent]  # the reference steps them: the native step starts from these too
        reference = runner.model(batch, runner.buffer.layers)
        for state, kept in zip(recurrent, before):
            state.copy_(kept)
        logits = native.run(batch)
        assert logits is not None and logits.shape == reference.shape
        prompt_rows = batch.input_ids.shape[0] - batch.num_decode
        if reference.numel():  # else a chunk that neither completes its prompt nor scores it
            diff = (logits.float() - reference.float()).abs().max().item()
            # the native logits are float32 whatever the dtype: their choice agrees when it is one of
            # the reference's maxima (bfloat16 logits tie what float32 tells apart)
            ref = reference.float()
            chosen = ref.gather(1, logits.float().argmax(-1, keepdim=True)).squeeze(1)
            same = bool((chosen == ref.max(-1).values).all())
            compared.append((batch.num_decode, prompt_rows, diff, reference.float().abs().max().item(), same))
        return logits

    runner.forward = forward
    # longer outputs than the default: the last requests decode alone (single-row iterations)
    run_arrivals(engine, random_arrival_jobs(seed, vocab=500, score_prompts=True, max_new_tokens=50))
    return compared, engine


VARIANTS = [
    "llama",
    "llama-mqa-bias-tied-llama3",
    "mistral-window8",
    "qwen2",
    "qwen3",
    "smollm3",
    "olmo2",
    "phi3",
    "gemma3",
    "llama-vocab509-kv4",
    "llama-head80-group6",
    "qwen3-moe",
    "mixtral",
    "gpt-oss",
    "granite",
    "qwen3_5",
    "qwen3_5-moe",
    "gemma4",
    "gemma4-moe",
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_native_step_gives_the_pytorch_logits_in_float32(make_model, variant):
    """Biases (qkv, o, mlp), a tied head, MQA, llama3 RoPE, a sliding window shorter than the
    sequences, an odd vocabulary: equal up to float32 summation order, in decode-only iterations
    of 1 to 6 rows, prompt chunks, and iterations mixing both."""
    compared, _ = compare_on_random_arrivals(make_model(variant), "float32")
    decode_only = {decode for decode, prompt, *_ in compared if not prompt}
    assert decode_only == set(range(1, 7))  # rows in tiles of 6, 4, 2 and 1
    assert sum(1 for decode, prompt, *_ in compared if decode and prompt) > 5  # mixed iterations
    # (Gemma 4: scores unscaled over normed q and k, softmax inputs up to head_dim wide; its
    # float32 noise is ~1e-6, ~2.5x the others', in every variant of its features alike)
    bound = 1e-5 if variant.startswith("gemma4") else 2e-6
    for decode, prompt, diff, scale, _ in compared:
        assert diff <= bound * max(1.0, scale), (decode, prompt, diff, scale)


@pytest.mark.parametrize(
    "variant",
    [
        "llama",
        "llama-mqa-bias-tied-llama3",
        "mistral-window8",
        "llama-head80-group6",
        "qwen3",
        "olmo2",
        "phi3",
        "gemma3",
        "qwen3-moe",
        "mixtral",
        "gpt-oss",
        "granite",
        "qwen3_5",
        "qwen3_5-moe",
        "gemma4",
        "gemma4-moe",
    ],
)
def test_native_step_rounds_as_pytorch_in_bfloat16(make_model, variant):
    """bfloat16 rounds every intermediate at the points PyTorch does: the logits stay within a
    few bfloat16 steps of the PyTorch forward's, and the greedy choice almost always agrees."""
    compared, _ = compare_on_random_arrivals(make_model(variant), "bfloat16")
    assert len(compared) > 20
    far = [
        (decode, prompt, diff, scale) for decode, prompt, diff, scale, _ in compared if diff > 0.02 * max(1.0, scale)
    ]
    # a mixture of experts: where a router's top k is a near tie, one bfloat16 step upstream can pick
    # another expert (seen once in 91 iterations); its logits then differ more, within bounds
    flips = 2 if variant in ("qwen3-moe", "mixtral", "gpt-oss") else 0
    if variant == "qwen3_5-moe":  # (4 routed layers over up to 24 rows an iteration: ~1 in 8 iterations, each ~5%)
        flips = 15
    flipped = 0.1  # (how far an iteration with a flipped router may go)
    if variant.startswith("gemma4"):  # (unscaled scores over normed q, k: a prompt's bfloat16 scores, which
        # PyTorch rounds before its softmax and the native step does not, step by 1/8 near 20; decode rows as
        # the others)
        far = [f for f in far if not f[1]]
    if variant == "gemma4-moe":  # (4 experts, 2 a token: a flip swaps half a row's experts; seen once in 66)
        flips, flipped = 2, 0.25
    assert len(far) <= flips and all(diff <= flipped * max(1.0, scale) for *_, diff, scale in far), far
    agree = sum(same for *_, same in compared) / len(compared)
    assert agree >= 0.9, agree


def test_every_kernel_family_of_this_cpu_is_built_and_named(llama_dir, kernel_family, caplog):
    """The families this CPU can execute include the portable one and, on x86-64 with AVX2 or
    AVX-512, those; the engine runs the family the override names and says so at start-up."""
    assert "generic" in FAMILIES
    flags = cpu_flags()
    if X86_V3 <= flags:
        assert "avx2" in FAMILIES
    if X86_V4 | {"avx512_vnni"} <= flags:
        assert "avx512vnni" in FAMILIES
    if X86_V4 | {"avx512_vnni", "avx512_bf16"} <= flags:
        assert "avx512bf16" in FAMILIES
    names = {
        "avx512bf16": "AVX-512F, VNNI and bfloat16 dot products",
        "avx512vnni": "AVX-512F, VNNI dot products",
        "avx512": "AVX-512F",
        "avx2": "AVX2+FMA",
        "neon": "NEON",
        "generic": "generic C",
    }
    with caplog.at_level(logging.INFO):
        engine = Engine(EngineConfig(llama_dir, dtype="bfloat16", max_slots=2))
    assert engine.runner.native.kernels == names[kernel_family]
    assert f"native step: {names[kernel_family]} kernels" in caplog.text
    assert engine.stats().native_kernels == names[kernel_family]


def test_a_kernel_family_this_cpu_cannot_run_is_refused_with_the_reason():
    with pytest.raises(NativeUnavailable, match="unknown kernel family 'sse9'"):
        kernel_flags("sse9")
    other = "neon" if platform.machine() == "x86_64" else "avx2"
    with pytest.raises(NativeUnavailable, match=f"kernel family {other} cannot run here"):
        kernel_flags(other)


def test_engine_without_a_compiler_decodes_with_pytorch(llama_dir, monkeypatch, caplog):
    """No compiler: a clear reason in the log, the dense weight copies released, PyTorch decodes."""
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeUnavailable, match="no-such-compiler"):
        build_library()
    engine = Engine(EngineConfig(llama_dir, dtype="float32", max_slots=2))
    assert engine.runner.native is None
    assert "native step off" in caplog.text and "no-such-compiler" in caplog.text
    qkv = engine.runner.model.layers[0].qkv
    assert qkv.weight is None and qkv.packed is not None  # packed for PyTorch, the dense copy released
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True), request_id="a")
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert len(finals[0].token_ids) == 5


def test_a_files_decoded_grids_and_head_go_once_the_native_step_has_copied_them(make_gguf_mix):
    """The native step copies a GGUF file's codes into its arena; the grids they were decoded into
    (a byte a code: 1.3 GB of a 1B Q4_K_M file's) and the released head's 16-bit values must go
    with PyTorch's copies, or the engine holds the model more than once."""
    gc.collect()
    grids = sum(isinstance(o, Grid) for o in gc.get_objects())
    engine = Engine(EngineConfig(make_gguf_mix("Q6_K"), dtype="bfloat16", quantization="auto", max_slots=2))
    assert engine.runner.native is not None and engine.config.quantization == "file"
    gc.collect()
    assert sum(isinstance(o, Grid) for o in gc.get_objects()) == grids
    vocab, hidden = engine.model_config.vocab_size, engine.model_config.hidden_size
    heads = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (vocab, hidden)]
    assert not heads  # the tied head's codes are the token lookup too


@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("bfloat16", "int4"), ("bfloat16", "int8")])
def test_the_native_step_alone_holds_the_projections_and_scores_long_sequences_in_chunks(
    llama_dir, dtype, quantization
):
    """With the native step on, PyTorch keeps no copy of any projection (one copy of the weights
    in memory), and Engine.score of a sequence longer than an iteration's token budget runs in
    chunks: the logits of the PyTorch engine (float32: up to summation order)."""
    config = dict(dtype=dtype, quantization=quantization, max_slots=2, max_seq_len=200, max_batch_tokens=48)
    native = Engine(EngineConfig(llama_dir, **config))
    linears = [m for m in native.runner.model.modules() if hasattr(m, "packed")]
    assert linears and all(m.weight is None and m.packed is None and m.quantized is None for m in linears)
    with pytest.raises(RuntimeError, match="released"):
        linears[0](torch.zeros(1, linears[0].shape[1], dtype=native.dtype))
    ids = [random.Random(1).randrange(500) for _ in range(150)]  # 4 chunks of 48
    got = native.score(ids).float()
    want = Engine(EngineConfig(llama_dir, native_forward="off", **config)).score(ids).float()
    assert got.shape == want.shape == (150, native.model_config.vocab_size)
    bound = 2e-6 if dtype == "float32" else 0.05
    assert (got - want).abs().max() <= bound * max(1.0, want.abs().max().item())


def test_models_the_step_does_not_cover_run_pytorch(make_model):
    assert Engine(EngineConfig(make_model("gptj"), dtype="float32", max_slots=2)).runner.native is None
    assert Engine(EngineConfig(make_model("llama"), dtype="float64", max_slots=2)).runner.native is None
    off = Engine(EngineConfig(make_model("llama"), dtype="float32", max_slots=2, native_forward="off"))
    assert off.runner.native is None
    assert off.runner.model.layers[0].qkv.weight is None  # no dense copy kept when off


@pytest.mark.parametrize(
    "dtype,quantization,family",
    [
        ("float32", "none", "llama"),
        ("bfloat16", "none", "llama"),
        ("bfloat16", "int4", "llama"),
        ("bfloat16", "int8", "llama"),
        ("bfloat16", "file", "llama"),
        ("float32", "none", "qwen3"),
        ("bfloat16", "none", "qwen3"),
        ("bfloat16", "file", "qwen3"),
        ("bfloat16", "none", "smollm3"),
        ("float32", "none", "olmo2"),
        ("bfloat16", "file", "olmo2"),
        ("bfloat16", "none", "phi3"),
        ("bfloat16", "file", "phi3-gguf"),
        ("float32", "none", "gemma3"),
        ("bfloat16", "int8", "gemma3"),
        ("float32", "none", "qwen3-moe"),
        ("bfloat16", "file", "qwen3-moe"),
        ("bfloat16", "file", "low-bits"),
        ("bfloat16", "int4", "mixtral"),
        ("bfloat16", "none", "gpt-oss"),
    ],
)
def test_a_rows_logits_do_not_depend_on_the_other_rows_of_its_iteration(
    request, make_model, tmp_path, dtype, quantization, family
):
    """Bit for bit: every sampled row of fused iterations (decode-only, and decode mixed with
    prompt chunks), recomputed alone right after on the cache the iteration left (a decode row
    as a decode row, a prompt row as a one-token prompt chunk: the two kinds have kernels of
    their own), gives the same logits. This is what makes fused and solo runs agree in float32
    and bfloat16 (test_engine.py), however a prompt is chunked. "file": a GGUF file's own codes
    of every block type (GGUF_MIX); qwen3: its q/k norms, a head_dim of its own, a Q8_0 file;
    smollm3: a layer without RoPE; olmo2: norms after attention and the MLP, q/k norms over each projection;
    low-bits: a MoE file of Q2_K, Q3_K and IQ4 blocks, experts included."""
    if family == "low-bits":  # Q2_K / Q3_K / IQ4 projections, experts and head
        types = {**GGUF_LOW_BITS, "ffn_gate_exps.weight": "Q2_K", "ffn_up_exps.weight": "Q3_K"}
        model = str(write_gguf(make_model("qwen3-moe-256"), tmp_path / "low.gguf", "IQ4_XS", types=types))
    elif family != "llama":
        model = make_model(family)
        model = str(write_gguf(model, tmp_path / f"{family}-Q8_0.gguf", "Q8_0")) if quantization == "file" else model
    else:
        model = request.getfixturevalue("gguf_mix" if quantization == "file" else "llama_dir")
    engine = Engine(
        EngineConfig(
            model,
            dtype=dtype,
            max_slots=8,
            max_batch_tokens=40,
            max_seq_len=128,
            prompt_first_iterations=0,
            quantization=quantization,
        )
    )  # mixed iterations
    native = engine.runner.native
    run, checked = native.run, {"decode": 0, "mixed": 0}

    def run_and_check(batch, greedy=False):  # logits always (no greedy ids): they are what is compared
        logits = run(batch)
        kind = "mixed" if batch.prefills else "decode"
        if batch.sample_rows.numel() >= 3 and checked[kind] < 3:
            checked[kind] += 1
            for out, row in enumerate(batch.sample_rows.tolist()):
                decode = row < batch.num_decode
                prefills = [] if decode else [PrefillSpan(0, 1, int(batch.write_slots[row]), int(batch.positions[row]))]
                alone = ForwardBatch(
                    input_ids=batch.input_ids[row : row + 1],
                    positions=batch.positions[row : row + 1],
                    write_slots=batch.write_slots[row : row + 1],
                    num_decode=int(decode),
                    decode_span=0,
                    decode_rows=None,
                    span_lens=None,
                    max_decode_len=0,
                    prefills=prefills,
                    sample_rows=torch.zeros(1, dtype=torch.int64),
                )
                assert torch.equal(run(alone)[0], logits[out]), (kind, row)
        return logits

    native.run = run_and_check
    rng = random.Random(0)
    for i in range(8):
        engine.add_request(
            [rng.randrange(500) for _ in range(rng.randint(5, 30))],
            SamplingParams(max_new_tokens=rng.randint(8, 20), ignore_eos=True),
            request_id=str(i),
        )
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert checked == {"decode": 3, "mixed": 3}


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("variant", ["llama", "llama-mqa-bias-tied-llama3", "qwen2"])
def test_native_quantized_kernels_give_the_pytorch_quantized_logits(make_model, variant, quantization):
    """--quantization int4 / int8: the native kernels (int4: codes, group scale and zero; int8:
    codes, row scale; the head int8 in both modes) against PyTorch's quantized kernel (up to 8 / 2
    rows) and its GEMMs on the dequantized weights (more rows): within a few bfloat16 steps (an
    int8 head under a tied embedding included). The greedy choice mostly agrees: the int8 head
    sums codes x scale exactly where PyTorch's many-row path reads the bfloat16-rounded
    dequantized head, and this random model's top logits are often near-ties."""
    compared, engine = compare_on_random_arrivals(make_model(variant), "bfloat16", quantization=quantization)
    assert engine.runner.native.quantized_projections == 4 * 2 + 1  # every projection of both layers, the head
    assert sum(1 for decode, prompt, *_ in compared if decode + prompt <= 8) > 20
    for decode, prompt, diff, scale, _ in compared:
        assert diff <= 0.02 * max(1.0, scale), (decode, prompt, diff, scale)
    assert sum(same for *_, same in compared) / len(compared) >= 0.8


@pytest.mark.parametrize("embedding", ["Q6_K", "Q4_K", "Q5_K", "Q8_0"])
def test_a_gguf_files_own_codes_give_the_pytorch_logits(make_gguf_mix, embedding):
    """--quantization auto on a GGUF file mixing Q4_K, Q4_0, Q6_K, Q5_K, Q5_0, Q5_1 and Q8_0 (q/k
    and v in different codes, as in Q4_K_M files) picks "file": every projection runs the
    kernels of its own codes (on int8 inputs: up to 6 bits as codes below 64, Q8_0 as signed bytes), the tied
    head too, and the token lookup reads the head's codes; against the PyTorch forward on their
    dequantized values within a few bfloat16 steps."""
    compared, engine = compare_on_random_arrivals(make_gguf_mix(embedding), "bfloat16", quantization="auto")
    assert engine.config.quantization == "file"
    native = engine.runner.native
    assert native.quantized_projections == 4 * 2 + 1 and not native.screens_greedy  # the head's codes: no screen
    assert "the file's own codes" in native.describe()
    # every projection takes int8 inputs (tiles_int8.c), Q8_0's down and head included; a head of
    # K-quant codes takes them in blocks of 256 (x8_block), the PyTorch forward's too
    # (quant.int8_block)
    assert native.int8_input_projections == native.quantized_projections
    assert engine.runner.model.lm_head.int8_inputs == (256 if embedding in ("Q4_K", "Q5_K", "Q6_K") else 32)
    rows = [decode + prompt for decode, prompt, *_ in compared]
    assert rows.count(1) >= 3 and max(rows) >= 9  # single rows, and more than one tile of rows
    # the kernels sum codes x inputs exactly where PyTorch reads bfloat16-rounded weights and
    # inputs: a bfloat16 step or two here and there (this random file's Q6_K embedding makes large
    # activations), and where the two paths' inputs differ by such a step an int8 input may round
    # the other way (one step of its block: per 256 inputs for the K-quants' projections, whose
    # steps are up to 8x those per 32: here medians 0.004-0.018 and largest 0.03-0.13 against
    # 0.004-0.015 and 0.03-0.06 when only Q4_K's took blocks of 256); a wrong code or scale is off
    # by the logits' own size
    relative = sorted(diff / max(1.0, scale) for _, _, diff, scale, _ in compared)
    assert relative[len(relative) // 2] <= 0.025 and relative[-1] <= 0.16, relative[-5:]
    assert sum(same for *_, same in compared) / len(compared) >= 0.8


@pytest.mark.parametrize("embedding", ["Q3_K", "IQ4_XS"])
def test_the_small_types_run_on_their_own_codes(make_gguf_mix, embedding):
    """A file of Q2_K, Q3_K, IQ4_NL and IQ4_XS blocks (a fused q/k/v of three kinds, the tied head
    and the token lookup in Q3_K or IQ4_XS) runs each in its own codes on int8 inputs (2 and 3
    bits with their super-blocks' scales, the IQ4 types' 4-bit indexes into their table), against
    the PyTorch forward on the file's values as test_a_gguf_files_own_codes_give_the_pytorch_logits."""
    from flover.native import abi

    path = make_gguf_mix(embedding, GGUF_LOW_BITS)
    compared, engine = compare_on_random_arrivals(path, "bfloat16", quantization="auto")
    native = engine.runner.native
    assert engine.config.quantization == "file" and native.quantized_projections == 4 * 2 + 1
    kinds = {grid.part[i].kind for grid in native._weights.grids for i in range(grid.parts)}
    assert {abi.G_Q2_K, abi.G_Q3_K, abi.G_IQ4_NL, abi.G_IQ4_XS} <= kinds
    assert native.int8_input_projections == native.quantized_projections
    # here 0.5% at the median, 1.1% at most (generic C and AVX2 alike); one sub-block's scale read
    # from its neighbour's place gives 2.2% (Q2_K's minimums) to 95% (Q3_K's) at the median
    relative = sorted(diff / max(1.0, scale) for _, _, diff, scale, _ in compared)
    assert relative[len(relative) // 2] <= 0.009 and relative[-1] <= 0.025, relative[-5:]
    assert sum(same for *_, same in compared) / len(compared) >= 0.8


def test_mxfp4_experts_run_on_their_4bit_codes(make_model, tmp_path):
    """A gpt-oss file as it ships (MXFP4 experts, Q8_0 elsewhere): the experts keep their 4-bit
    codes (G_MXFP4: each looked up as its FP4 value before the int8 dot products), and the logits
    are the PyTorch forward's on the dequantized values within a few bfloat16 steps, the same on
    every kernel family (a wrong table entry or scale is off by the logits' own size)."""
    from flover.native import abi

    path = write_gguf(make_model("gpt-oss"), tmp_path / "oss.gguf", "Q8_0", types={"_exps.weight": "MXFP4"})
    compared, engine = compare_on_random_arrivals(str(path), "bfloat16", quantization="auto")
    kinds = {grid.part[i].kind for grid in engine.runner.native._weights.grids for i in range(grid.parts)}
    assert abi.G_MXFP4 in kinds and engine.config.quantization == "file"
    # here 0.41% at the median, 0.61% at most (the same on every family); one table entry off by a
    # sixth (the largest FP4 value read as 11 for 12) gives 0.67% / 0.97%: the bounds tell them apart
    relative = sorted(diff / max(1.0, scale) for _, _, diff, scale, _ in compared)
    assert relative[len(relative) // 2] <= 0.0055 and relative[-1] <= 0.008, relative[-5:]
    assert sum(same for *_, same in compared) / len(compared) >= 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_argmax_gives_torch_argmax_ids(dtype):
    """Greedy ids from the native loops equal torch.argmax's: the first of tied maxima (bfloat16
    rounding makes many), NaN counting as the maximum, rows of -inf or all negative, a vocabulary that is not a
    multiple of 16, rows that are a slice of wider ones, one row and many."""
    lib = load_library()
    generator = torch.Generator().manual_seed(1)
    for vocab in (1, 7, 16, 1000, 4099):
        wide = (torch.randn(40, vocab + 5, generator=generator) * 3).round().to(dtype)  # many ties
        logits = wide[:, :vocab]  # rows vocab + 5 apart
        logits[1, vocab // 2] = float("nan")
        logits[2].fill_(float("-inf"))
        logits[3, -1] = float("nan")
        logits[4, -1] = float("inf")
        logits[5, 0] = float("nan")
        logits[5, -1] = float("inf")
        logits[6] = -logits[6].abs() - 1  # below every padding value a vector loop might use
        for rows in (logits, logits[:1], logits[1:2], logits[:3]):
            assert argmax(lib, rows, 2) == rows.argmax(-1).tolist(), (vocab, rows.shape)


def edited_copy(model_dir: str, out: Path, edit) -> str:
    """A copy of the checkpoint in `out` whose tensors (name -> tensor) edit() changed in place."""
    shutil.copytree(model_dir, out)
    path = next(out.glob("*.safetensors"))
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return str(out)


def near_tied_head(tensors: dict) -> None:
    """Vocabulary rows of the LM head (the embedding when tied) in pairs that bfloat16 can hardly
    tell apart. A third of the pairs exactly equal (a tie: the first index wins); a third one
    float32 step apart in each weight, up or down (which of the two is larger can depend on
    the order of the sum's roundings); a third ~2^-9 apart in each weight, bfloat16's own resolution, so that
    the screen often orders the two wrongly."""
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    generator = torch.Generator().manual_seed(3)
    first, second = head[0::2][: head.shape[0] // 2], head[1::2]
    noise = torch.randn(second.shape, generator=generator) * 2e-3 * first.abs()
    noise[0::3] = 0
    noise[1::3] = 0
    second.copy_(first + noise)
    nudged = second[1::3]
    sign = torch.randint(0, 2, nudged.shape, generator=generator) * 2 - 1
    nudged.copy_(torch.nextafter(nudged, sign * torch.tensor(float("inf"))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["llama", "llama-mqa-bias-tied-llama3", "llama-vocab509-kv4"])
def test_greedy_through_the_screened_head_gives_the_argmax_of_every_logit(make_model, variant, dtype, tmp_path):
    """Greedy rows take their ids from a screen of the LM head (float32: a bfloat16 copy;
    bfloat16: int8) plus the few candidates summed exactly (llama_forward.c, "greedy through a
    screen of the LM head"): on a head whose rows come in near-ties that the screen's rounding
    reorders, and in exact ties, every iteration's ids equal the first argmax of the whole head's
    logits on the same state."""
    model_dir = edited_copy(make_model(variant), tmp_path / "near-ties", near_tied_head)
    engine = Engine(
        EngineConfig(model_dir, dtype=dtype, max_slots=6, max_batch_tokens=24, max_seq_len=110, speculate=0)
    )  # one row per request: the screen's row counts
    native = engine.runner.native
    assert native.screens_greedy
    run, compared = native.run, []

    def run_and_check(batch, greedy=False):
        out = run(batch, greedy=greedy)
        if greedy and batch.sample_rows.numel():
            assert isinstance(out, list)
            compared.append((out, run(batch)))  # the same iteration with every logit
        return out

    native.run = run_and_check
    jobs = [
        (at, prompt, dataclasses.replace(params, temperature=0.0))
        for at, prompt, params in random_arrival_jobs(0, vocab=500, max_new_tokens=30)
    ]
    run_arrivals(engine, jobs)
    rows = sum(len(ids) for ids, _ in compared)
    assert rows > 100 and native.screened_rows == rows
    assert native.full_head_rows < rows / 10  # the screen, not the fallback, decided
    near = 0
    for ids, logits in compared:
        assert ids == logits.argmax(-1).tolist()
        for row, i in enumerate(ids):  # the winner's pair partner within bfloat16's resolution of it
            top, partner = logits[row, i].item(), logits[row, i ^ 1].item() if (i ^ 1) < logits.shape[1] else 0.0
            near += 0 <= abs(top - partner) < 2**-6 * abs(top)
    assert near > 20, near  # decided by the exact sums of the candidates, not by the screen


@pytest.mark.parametrize("variant", ["llama", "llama-vocab509-kv4"])
def test_greedy_beyond_the_screen_gives_the_argmax_of_every_logit(make_model, variant, tmp_path):
    """bfloat16 iterations with more greedy rows than the screen takes (SCREEN_INT8_ROWS) get
    their ids from the whole head, its argmax taken as its tiles come out (llama_forward.c,
    "greedy through the whole head"), no logits stored: on the near-tied head, every such
    iteration's ids equal the first argmax of its logits (exact ties: the first index)."""
    model_dir = edited_copy(make_model(variant), tmp_path / "near-ties", near_tied_head)
    engine = Engine(
        EngineConfig(model_dir, dtype="bfloat16", max_slots=16, max_batch_tokens=48, max_seq_len=110, speculate=0)
    )
    native = engine.runner.native
    run, compared = native.run, []

    def run_and_check(batch, greedy=False):
        out = run(batch, greedy=greedy)
        if greedy and batch.sample_rows.numel() > native.screen_rows:
            assert isinstance(out, list)
            compared.append((list(out), run(batch)))  # the same iteration with every logit
        return out

    native.run = run_and_check
    jobs = [
        (at // 4, prompt, dataclasses.replace(params, temperature=0.0))
        for seed in (0, 1)
        for at, prompt, params in random_arrival_jobs(seed, vocab=500, max_new_tokens=30)
    ]
    run_arrivals(engine, jobs)
    rows = sum(len(ids) for ids, _ in compared)
    assert len(compared) > 10 and rows > 150 and native.full_head_rows >= rows
    ties = 0
    for ids, logits in compared:
        assert ids == logits.argmax(-1).tolist()
        ties += sum(
            logits[row, i].item() == logits[row, i ^ 1].item() for row, i in enumerate(ids) if (i ^ 1) < logits.shape[1]
        )
    assert ties > 20, ties  # exact ties met, the first index taken


def _with_final_norm(make_model, fill: float, tmp_path, **config):
    """The native step of a model whose final norm is all `fill`: zeros from the file; NaN set in
    the loaded weights (a file holding NaN is refused at load: tests/test_model_files.py), as a
    run-time overflow would leave them."""
    if fill == fill:
        model_dir = edited_copy(
            make_model("llama"), tmp_path / "norm", lambda tensors: tensors["model.norm.weight"].fill_(fill)
        )
        return Engine(EngineConfig(model_dir, **config)).runner.native
    engine = Engine(EngineConfig(make_model("llama"), **config))
    engine.runner.model.norm.fill_(fill)  # (the native step reads this tensor's memory)
    return engine.runner.native


def _one_prompt(n: int) -> ForwardBatch:
    """A batch of one prompt of n tokens (ids 5, 6, ...) in slot 0, every row sampled."""
    return ForwardBatch(
        input_ids=torch.arange(5, 5 + n),
        positions=torch.arange(n),
        write_slots=torch.zeros(n, dtype=torch.int64),
        num_decode=0,
        decode_span=0,
        decode_rows=None,
        span_lens=None,
        max_decode_len=0,
        prefills=[PrefillSpan(0, n, 0, 0)],
        sample_rows=torch.arange(n),
    )


def test_the_native_step_keeps_the_kv_buffer_it_writes_alive(make_model):
    """Its structs hold raw addresses into the runner's KV mapping: an engine dropped while its
    native step is kept (as the helpers here do) must not unmap that memory under it (it did: the
    full suite died of a segmentation fault in the test below)."""
    engine = Engine(EngineConfig(make_model("llama"), dtype="bfloat16", max_slots=4, max_seq_len=64))
    native, kv = engine.runner.native, weakref.ref(engine.runner.buffer)
    del engine
    gc.collect()
    assert kv() is not None, "the KV buffer went while the native step still points into it"
    assert native.run(_one_prompt(12)).isfinite().all()


@pytest.mark.parametrize("fill", [0.0, float("nan")])
def test_greedy_beyond_the_screen_with_every_logit_equal_or_nan(make_model, fill, tmp_path):
    """A final norm of zeros (every logit 0) or NaN, 12 bfloat16 greedy rows: the ids are
    torch.argmax's (0: the first maximum, or the first NaN)."""
    native = _with_final_norm(
        make_model, fill, tmp_path, dtype="bfloat16", max_slots=4, max_batch_tokens=16, max_seq_len=64
    )
    batch = _one_prompt(12)
    before = native.full_head_rows
    ids = native.run(batch, greedy=True)
    assert ids == native.run(batch).argmax(-1).tolist() == [0] * 12
    assert fill == fill or native.run(batch).isnan().all()
    assert native.full_head_rows - before == 12


@pytest.mark.parametrize("fill", [0.0, float("nan")])
def test_screened_greedy_takes_every_logit_when_the_screen_cannot_decide(make_model, fill, tmp_path):
    """A final norm of zeros (every logit 0: all candidates) or NaN (NaN logits): the rows take the
    whole float32 head, and the ids are still torch.argmax's (0: the first maximum, or NaN)."""
    native = _with_final_norm(
        make_model, fill, tmp_path, dtype="float32", max_slots=4, max_batch_tokens=16, max_seq_len=64
    )
    batch = _one_prompt(3)
    ids = native.run(batch, greedy=True)
    assert ids == native.run(batch).argmax(-1).tolist() == [0, 0, 0]
    assert fill == fill or native.run(batch).isnan().all()
    assert native.full_head_rows == native.screened_rows == 3


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-moe"])
@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "file")])
def test_recurrent_layers_fused_equal_solo_bit_for_bit(make_model, tmp_path, variant, dtype, quantization):
    """Qwen3.5's Gated DeltaNet layers on the native step: six prompts (up to ~200 tokens) fused in
    iterations of 40 rows (prompt chunks beside decode rows, runs of one sequence's rows) give each
    prompt's tokens and log-probabilities as it gets alone, bit for bit; on the file's own codes too."""
    model = make_model(variant)
    if quantization == "file":
        model = str(write_gguf(model, tmp_path / f"{variant}-Q8_0.gguf", "Q8_0"))
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (5, 190, 33, 70, 12, 129)]
    params = [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True, logprobs=True) for i in range(len(prompts))]

    def run(slots: int) -> list[tuple[list[int], list[float]]]:
        config = EngineConfig(model, dtype=dtype, max_slots=slots, max_batch_tokens=40, max_seq_len=256)
        llm = LLM.from_engine(Engine(config))
        assert llm.engine.runner.native is not None
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]

    assert run(6) == run(1)


@pytest.mark.parametrize(
    "variant,dtype,quantization",
    [
        ("gemma4", "float32", "none"),
        ("gemma4", "bfloat16", "none"),
        ("gemma4", "bfloat16", "file"),
        ("gemma4-moe", "bfloat16", "file"),
    ],
)
def test_gemma4_layers_fused_equal_solo_bit_for_bit(make_model, tmp_path, variant, dtype, quantization):
    """Gemma 4's E shape on the native step (layers of two head shapes, two reading earlier layers'
    KV, per-layer inputs, wide MLPs, layer scalars, soft-capped logits): six prompts fused in
    iterations of 40 rows give each prompt's tokens and log-probabilities as it gets alone, bit for
    bit; on a Q8_0 file's own codes too (its per-layer table read a row at a time; the MoE's experts
    beside the MLP)."""
    if variant == "gemma4":  # (per-layer inputs of 32: Q8_0 blocks)
        model = make_tiny_model("gemma4", TEST_PRESET, tmp_path / "hf", hidden_size_per_layer_input=32)
    else:
        model = make_model(variant)
    if quantization == "file":
        model = write_gguf(model, tmp_path / "gemma4-Q8_0.gguf", "Q8_0")
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (5, 190, 33, 70, 12, 129)]
    params = [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True, logprobs=True) for i in range(len(prompts))]

    def run(slots: int) -> list[tuple[list[int], list[float]]]:
        config = EngineConfig(str(model), dtype=dtype, max_slots=slots, max_batch_tokens=40, max_seq_len=256)
        llm = LLM.from_engine(Engine(config))
        assert llm.engine.runner.native is not None
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]

    assert run(6) == run(1)
