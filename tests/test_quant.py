"""Weight-only quantization (`--quantization int8|int4`) and the `--dtype auto` default."""

from __future__ import annotations

import subprocess
import sys

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
