"""Weight-only quantization (`--quantization int8|int4`) and the `--dtype auto` default."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from flover import LLM, Engine, EngineConfig, SamplingParams
from flover.hardware import cpu_flags, resolve_dtype
from flover.models.layers import Linear
from flover.models.quant import INT4_GROUP, MAX_ROWS, quantize

needs_kernels = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="this torch build has no CPU int4 kernel"
)


def linear_with(weight: torch.Tensor, mode: str) -> Linear:
    lin = Linear(weight.shape[0], weight.shape[1], False, torch.bfloat16, torch.device("cpu"))
    lin.weight.data = weight.clone()
    lin.quantize(mode)
    lin.pack(32)
    return lin


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_quantized_kernel_and_the_16bit_gemm_compute_the_same_weights(mode):
    """Few rows take the quantized kernel, many rows the packed 16-bit GEMM of the dequantized
    weights: the same row must come out (up to bfloat16 rounding) either way."""
    torch.manual_seed(0)
    lin = linear_with((torch.randn(96, 128) * 0.05).bfloat16(), mode)
    x = torch.randn(MAX_ROWS[mode] + 5, 128).bfloat16()
    many = lin(x)  # the 16-bit path
    few = lin(x[:1])  # the quantized kernel
    assert few.shape == (1, 96) and many.shape == (x.shape[0], 96)
    scale = many[:1].abs().max().item()
    assert (few.float() - many[:1].float()).abs().max().item() <= 0.02 * scale


@needs_kernels
def test_int4_keeps_a_q4_1_grid():
    """Weights that already lie on a GGUF Q4_1 grid (scale * q + min per 32 inputs) keep their
    4-bit codes: what int4 changes is only the bfloat16 rounding any bfloat16 model has, while
    weights off such a grid move by up to half a step."""
    torch.manual_seed(1)
    out, inp = 64, 4 * INT4_GROUP
    scale = torch.rand(out, inp // INT4_GROUP, 1) * 0.01 + 0.001
    low = torch.randn(out, inp // INT4_GROUP, 1) * 0.05
    q = torch.randint(0, 16, (out, inp // INT4_GROUP, INT4_GROUP)).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans the whole grid, as a quantizer leaves it
    on_grid = (q * scale + low).view(out, inp)
    bf16_error = (on_grid.bfloat16().float() - on_grid).abs().max().item()
    _, dequantized = quantize(on_grid.bfloat16(), "int4")
    assert (dequantized.float() - on_grid).abs().max().item() <= 3 * bf16_error
    off_grid = on_grid + torch.rand_like(on_grid) * scale.repeat_interleave(INT4_GROUP, -1).view(out, inp) * 0.5
    _, moved = quantize(off_grid.bfloat16(), "int4")
    assert (moved.float() - off_grid).abs().max().item() > 4 * bf16_error


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_engine_stays_close_to_bfloat16_and_decodes_like_it_scores(llama_dir, mode):
    prompt = list(range(5, 40))
    plain = Engine(EngineConfig(llama_dir, dtype="bfloat16", max_slots=2, max_seq_len=64))
    quant_llm = LLM(llama_dir, dtype="bfloat16", max_slots=2, max_seq_len=64, quantization=mode)
    quant = quant_llm.engine
    # Teacher forcing (many rows: the dequantized 16-bit path): next-token choices agree.
    a, b = plain.score(prompt).float(), quant.score(prompt).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.85
    assert not torch.equal(a, b)  # the weights really changed
    # Decoding one request (one row: the quantized kernel) gives the logprobs that scoring the
    # same tokens (many rows) gives: both kernels compute one model.
    result = quant_llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True))[0]
    scored = torch.log_softmax(quant.score(prompt + result.token_ids[:-1]).float(), -1)
    rows = scored[len(prompt) - 1 :]
    expected = rows.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(result.logprobs), expected, atol=0.15)


def test_quantization_needs_bfloat16_on_cpu(llama_dir):
    for dtype in ("float32", "float64", "float16"):
        with pytest.raises(ValueError, match="quantization='int4' runs on CPU with dtype bfloat16"):
            Engine(EngineConfig(llama_dir, dtype=dtype, quantization="int4"))
    with pytest.raises(ValueError, match="quantization=.int2.: choose one of auto, none, int8, int4, file"):
        Engine(EngineConfig(llama_dir, dtype="bfloat16", quantization="int2"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flover.apps.cli",
            "generate",
            "--model",
            llama_dir,
            "--dtype",
            "float32",
            "--quantization",
            "int8",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("flover: error: quantization='int8' runs on CPU")


def test_dtype_auto_picks_bfloat16_where_the_cpu_computes_it_or_the_native_step_widens_it(tmp_path):
    with_bf16 = tmp_path / "zen4"
    with_bf16.write_text(
        "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
    )
    without = tmp_path / "zen2"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert "avx512_bf16" in cpu_flags(str(with_bf16))
    assert not cpu_flags(str(without)) & {"avx512_bf16", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
    assert resolve_dtype("float64", "cpu") == "float64"  # explicit choices are kept
    zen4, zen2 = cpu_flags(str(with_bf16)), cpu_flags(str(without))
    assert resolve_dtype("auto", "cpu", native_step=False, flags=zen4) == "bfloat16"  # PyTorch computes it natively
    assert resolve_dtype("auto", "cpu", native_step=True, flags=zen2) == "bfloat16"  # widened by the native step
    assert resolve_dtype("auto", "cpu", native_step=False, flags=zen2) == "float32"  # PyTorch would emulate it
    assert resolve_dtype("auto", "cpu", flags={"fpu", "sse2"}) == "float32"  # no vector kernels to widen it
    assert resolve_dtype("auto", "cpu", flags={"fp", "asimd"}) == "bfloat16"  # AArch64's NEON


def test_the_engine_reports_the_dtype_auto_chose(llama_dir):
    engine = Engine(EngineConfig(llama_dir, max_seq_len=32, max_slots=1))
    assert engine.config.dtype == resolve_dtype("auto", "cpu")
    assert engine.buffer.kv.dtype == getattr(torch, engine.config.dtype)


def test_int8_inputs_quantize_per_block_as_llama_cpps_q8_rows():
    """int8_inputs(x, 32) and (x, 256): per block d = max |x| / 127, x ~ round(x / d) d, in float32
    step for step (the native step's int8_rows): an outlier sets the step of its whole block, 32
    inputs (Q8_0) or 256 (Q8_K)."""
    from flover.models.quant import int8_inputs

    torch.manual_seed(0)
    x = torch.randn(3, 512)
    x[1, 5] = 40.0  # (an outlier in the first block of row 1)
    for block in (32, 256):
        got = int8_inputs(x, block)
        blocks = x.view(3, -1, block)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        want = (torch.round(blocks * (1 / d)) * d).view(3, 512)
        assert torch.equal(got, want)
        steps = (got.view(3, -1, block) / d).flatten()
        assert (steps - steps.round()).abs().max() < 1e-3 and steps.abs().max().round() == 127
    # the outlier's step reaches 256 inputs per 256, 32 per 32: inputs 32..255 of row 1 round coarser
    coarse, fine = int8_inputs(x, 256)[1, 32:256], int8_inputs(x, 32)[1, 32:256]
    assert (coarse - x[1, 32:256]).abs().max() > 4 * (fine - x[1, 32:256]).abs().max()


def test_only_projections_all_in_k_quants_take_inputs_in_blocks_of_256():
    """quant.int8_block: a projection whose runs are all Q4_K's, Q5_K's or Q6_K's (inputs a
    multiple of 256: a Q4_K_M file's q/k/v with its Q6_K v too) takes its int8 inputs per 256, as
    the native step's x8_block does for its runs of those kinds (5- and 6-bit codes packed or as
    bytes); one with another type or a slice off the super-blocks per 32. The native runs refuse
    a QuantizedWeight that says otherwise."""
    from flover.models.gguf_grids import block_grid
    from flover.models.quant import Grid, file_weight
    from flover.native.grids import runs_of

    rng = np.random.default_rng(0)

    def grid(type_name: str, rows: int, inputs: int):
        block_bytes, block_values = {"Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256), "Q8_0": (34, 32)}[
            type_name
        ]
        raw = rng.integers(0, 256, rows * inputs // block_values * block_bytes, dtype=np.uint8)
        for i in range(0, raw.size, block_bytes):  # float16 d (and dmin) small and finite
            at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (block_bytes - 2,), "Q8_0": (0,)}[type_name]
            for j in at:
                raw[i + j : i + j + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        found = block_grid(type_name, raw, (rows, inputs))
        tensors = [None if a is None else torch.from_numpy(a) for a in (found.codes, found.scale, found.low)]
        supers = tuple(torch.from_numpy(a) for a in found.supers) if found.supers else None
        return Grid(*tensors, found.group, found.bits, found.code_range, supers)

    def cut(g: Grid) -> Grid:  # a tensor-parallel slice through a super-block: the stored scales serve (gguf_file)
        return Grid(g.codes[:, :384], g.scale[:, :12], g.low[:, :12], g.group, g.bits, g.code_range, None)

    for grids, block in [
        ([grid("Q4_K", 32, 512), grid("Q4_K", 32, 512)], 256),
        ([grid("Q4_K", 32, 512), grid("Q6_K", 32, 512)], 256),
        ([grid("Q6_K", 32, 512)], 256),
        ([grid("Q5_K", 32, 512), grid("Q6_K", 32, 512)], 256),  # a Q5_K_M file's q/k/v
        ([grid("Q6_K", 32, 512), grid("Q8_0", 32, 512)], 32),
        ([grid("Q4_K", 32, 512), grid("Q8_0", 32, 512)], 32),
        ([cut(grid("Q4_K", 32, 512))], 32),
    ]:
        values = torch.zeros(sum(g.codes.shape[0] for g in grids), grids[0].codes.shape[1])
        quantized, _ = file_weight(grids, values, torch.bfloat16)
        assert quantized.int8_inputs == block
        for packed in (False, True):
            runs_of(quantized, packed)
        quantized.int8_inputs = 32 if block == 256 else 256
        for packed in (False, True):
            with pytest.raises(ValueError, match="int8 inputs in blocks of"):
                runs_of(quantized, packed)
        quantized.int8_inputs = block
