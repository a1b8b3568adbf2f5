"""The native step of embeddings-only models: BERT-family encoders (flover/native/encoder_forward.c)
and EmbeddingGemma (llama_forward.c with attention both ways). The PyTorch forward's vectors and
scores within rounding; a vector or a pair's score the same bits alone and fused in float32,
bfloat16 and on a GGUF file's Q8_0 codes; `--dtype auto` for them."""

from __future__ import annotations

import pytest
import torch

from flover import LLM
from flover.engine.settings import bfloat16_by_default
from flover.hardware import native_bfloat16
from flover.models import open_checkpoint
from flover.native.encoder import NativeEncoder
from flover.native.forward import NativeForward
from flover.testing.embedding_model import (
    make_tiny_bert,
    make_tiny_cross_encoder,
    make_tiny_embedding_gemma,
    make_tiny_nomic_bert,
    write_bert_gguf,
    write_embedding_gemma_gguf,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Über café: naïve 東京 data, 数据 and models ✓",
    "fuse batch request token model layer memory slot buffer kernel iteration arrive finish " * 6,
    "a man is eating food " * 8,  # (over 64 tokens: more than one block of attention queries)
]
QUERY = "which city is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the quick brown fox", "berlin is in germany, not france " * 5]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    return str(make_tiny_bert(tmp_path_factory.mktemp("bert"), "mean"))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    return str(make_tiny_cross_encoder(tmp_path_factory.mktemp("cross"), "bert"))


@pytest.fixture(scope="module")
def nomic_bert(tmp_path_factory) -> str:
    return str(make_tiny_nomic_bert(tmp_path_factory.mktemp("nomic")))


@pytest.fixture(scope="module")
def embedding_gemma(tmp_path_factory) -> str:
    """6 layers (5 of them sliding: keys less than 5 away on either side; TEXTS are longer)."""
    return str(make_tiny_embedding_gemma(tmp_path_factory.mktemp("embeddinggemma"), layers=6))


def vectors(llm: LLM, texts) -> torch.Tensor:
    return torch.tensor([o.embedding for o in llm.embed(texts)], dtype=torch.float64)


def native_of(llm: LLM) -> NativeEncoder:
    native = llm.engine.runner.native
    assert isinstance(native, NativeEncoder), "the encoder's native step did not load"
    return native


@pytest.mark.parametrize("dtype, within", [("float32", 1e-5), ("bfloat16", 3e-3)])
def test_the_native_step_gives_the_pytorch_forwards_vectors(bert, dtype, within):
    """Attention one way only, a wrong LayerNorm or GELU would be far off (bfloat16: measured 2.8e-4)."""
    native, eager = LLM(bert, dtype=dtype), LLM(bert, dtype=dtype, native_forward="off")
    assert eager.engine.runner.native is None
    got = vectors(native, TEXTS)
    assert native_of(native).iterations > 0
    assert (got - vectors(eager, TEXTS)).abs().max().item() < within


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_vector_is_the_same_bits_alone_and_fused(bert, dtype):
    llm = LLM(bert, dtype=dtype)
    alone = torch.stack([vectors(llm, [text])[0] for text in TEXTS])
    iterations = native_of(llm).iterations
    fused = vectors(llm, TEXTS * 3)
    assert native_of(llm).iterations == iterations + 1  # (all 15 in one iteration)
    assert torch.equal(fused, alone.repeat(3, 1))


def test_a_cross_encoders_pairs_score_as_pytorch_and_the_same_alone_and_fused(cross_encoder):
    """A pair's second part has token type 1 (a table row the native step must look up)."""
    llm = LLM(cross_encoder, dtype="float32")
    fused = llm.score(QUERY, DOCUMENTS * 2)
    assert native_of(llm).iterations > 0
    assert fused == [llm.score(QUERY, d)[0] for d in DOCUMENTS] * 2
    eager = LLM(cross_encoder, dtype="float32", native_forward="off").score(QUERY, DOCUMENTS)
    assert max(abs(a - b) for a, b in zip(fused, eager)) < 1e-5


def test_a_q8_0_bert_file_runs_on_its_codes(bert, tmp_path):
    """llama-quantize's Q8_0 layers: the native step's int8 kernels on the file's codes, within
    Q8_0's error of the dequantized weights' vectors, and the same bits alone and fused."""
    path = str(write_bert_gguf(bert, tmp_path / "bert-q8_0.gguf", qtype="Q8_0"))
    llm = LLM(path, dtype="bfloat16")
    assert llm.engine.config.quantization == "file"
    assert native_of(llm).quantized_projections == 8  # (2 layers x qkv, o, up, down)
    fused = vectors(llm, TEXTS * 2)
    assert torch.equal(fused, torch.stack([vectors(llm, [t])[0] for t in TEXTS]).repeat(2, 1))
    dequantized = LLM(path, dtype="float32", native_forward="off")
    cosine = torch.nn.functional.cosine_similarity(fused[: len(TEXTS)], vectors(dequantized, TEXTS))
    assert cosine.min().item() > 0.995


def test_dtype_auto_keeps_an_encoder_in_float32_where_bfloat16_is_only_widened(bert, tmp_path):
    cfg = open_checkpoint(bert).model_config()
    assert not bfloat16_by_default("auto", cfg, "none")
    assert bfloat16_by_default("auto", cfg, "file")  # (a quantized file's codes take bfloat16 inputs)
    assert not bfloat16_by_default("off", cfg, "file")
    want = "bfloat16" if native_bfloat16("cpu") else "float32"
    assert LLM(bert).engine.config.dtype == want


@pytest.mark.parametrize("dtype, within", [("float32", 1e-5), ("bfloat16", 1.5e-2)])
def test_embedding_gemma_runs_natively_with_attention_both_ways(embedding_gemma, dtype, within):
    """Its sliding layers see keys on either side within the window, its global ones the whole
    input: causal attention or a one-way window moves every vector (bfloat16: measured 3.8e-3 from
    the PyTorch forward, both 6e-3 from float64); fused, a vector is the same bits as alone."""
    llm, eager = LLM(embedding_gemma, dtype=dtype), LLM(embedding_gemma, dtype=dtype, native_forward="off")
    assert isinstance(llm.engine.runner.native, NativeForward) and eager.engine.runner.native is None
    fused = vectors(llm, TEXTS * 2)
    assert (fused[: len(TEXTS)] - vectors(eager, TEXTS)).abs().max().item() < within
    assert torch.equal(fused, torch.stack([vectors(llm, [t])[0] for t in TEXTS]).repeat(2, 1))


def test_a_q8_0_gemma_embedding_file_runs_on_its_codes(embedding_gemma, tmp_path):
    path = str(write_embedding_gemma_gguf(embedding_gemma, tmp_path / "embeddinggemma-q8_0.gguf", qtype="Q8_0"))
    llm = LLM(path, dtype="bfloat16")
    assert llm.engine.config.quantization == "file" and llm.engine.runner.native.quantized_projections > 0
    fused = vectors(llm, TEXTS * 2)
    assert torch.equal(fused, torch.stack([vectors(llm, [t])[0] for t in TEXTS]).repeat(2, 1))
    dequantized = LLM(path, dtype="float32", native_forward="off")
    cosine = torch.nn.functional.cosine_similarity(fused[: len(TEXTS)], vectors(dequantized, TEXTS))
    assert cosine.min().item() > 0.99


@pytest.mark.parametrize("dtype, within", [("float32", 1e-5), ("bfloat16", 1e-3)])
def test_nomic_bert_runs_natively(nomic_bert, dtype, within):
    """RoPE on q and k in place of the position table, SwiGLU, no biases: the PyTorch forward's
    vectors (bfloat16: measured 2.2e-4), the same bits alone and fused."""
    llm, eager = LLM(nomic_bert, dtype=dtype), LLM(nomic_bert, dtype=dtype, native_forward="off")
    fused = vectors(llm, TEXTS * 2)
    assert native_of(llm).iterations > 0
    assert (fused[: len(TEXTS)] - vectors(eager, TEXTS)).abs().max().item() < within
    assert torch.equal(fused, torch.stack([vectors(llm, [t])[0] for t in TEXTS]).repeat(2, 1))
