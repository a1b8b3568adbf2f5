"""Embeddings from decoders: float64 vectors equal sentence-transformers' on the same checkpoint, a
vector is the same bits whatever shares its iterations (generation rows, other inputs, prompt
chunks), and bad inputs get a clear error."""

from __future__ import annotations

import pytest
import torch

from flover import LLM, SamplingParams
from flover.engine.intake import PromptTooLong
from flover.models.model_config import CheckpointError
from flover.models.pooling import Pooling
from flover.request import EmbedParams, RequestInput
from flover.runner.pooling import PooledRows
from flover.testing.embedding_model import as_sentence_transformer

TEXTS = [
    "the cat sat on the mat",
    "a river runs through the city when the light is green",
    "hi",
    "fuse batch request token model layer memory slot buffer kernel iteration " * 3,
]


@pytest.fixture(scope="module")
def embedder(make_model, tmp_path_factory):
    """embedder(variant, mode, normalize=True) -> a sentence-transformers copy of a test checkpoint."""
    made = {}

    def make(variant: str, mode: str, normalize: bool = True) -> str:
        key = (variant, mode, normalize)
        if key not in made:
            out = tmp_path_factory.mktemp(f"st-{variant}-{mode}")
            made[key] = str(as_sentence_transformer(make_model(variant), out, mode, normalize))
        return made[key]

    return make


def reference(model_dir: str, texts: list[str]) -> torch.Tensor:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(model_dir, device="cpu", model_kwargs={"dtype": torch.float64})
    return model.encode(texts, convert_to_tensor=True)  # (batched: padded as users run it)


@pytest.mark.parametrize(
    "variant, mode, normalize",
    [("qwen3", "last", True), ("llama", "mean", True), ("qwen2", "cls", False), ("llama", "max", True)],
)
def test_float64_vectors_equal_sentence_transformers(embedder, variant, mode, normalize):
    model_dir = embedder(variant, mode, normalize)
    want = reference(model_dir, TEXTS)
    got = torch.tensor([o.embedding for o in LLM(model_dir, dtype="float64").embed(TEXTS)], dtype=torch.float64)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-9


def embed_while_generating(llm: LLM, texts: list[str]) -> list[list[float]]:
    """The texts' vectors, queued while four greedy generations run (their decode rows share the
    iterations), the generations' own outputs checked to be whole."""
    engine = llm.engine
    gens = [engine.add_request("once upon a time " * k, SamplingParams(max_new_tokens=12)) for k in range(1, 5)]
    for _ in range(2):
        engine.step()
    ids = [engine.enqueue(engine.make_request(RequestInput(t, embed=EmbedParams()))) for t in texts]
    finals = {}
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [len(finals[g].token_ids) for g in gens] == [12] * 4
    assert all(finals[i].embedding is not None and finals[i].text is None for i in ids)
    return [finals[i].embedding for i in ids]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_vector_is_the_same_bits_alone_fused_and_chunked(embedder, dtype):
    model_dir = embedder("qwen3", "mean")
    alone = LLM(model_dir, dtype=dtype)
    assert alone.engine.runner.native is not None  # (the native step runs these iterations)
    solo = [alone.embed(t)[0].embedding for t in TEXTS]
    assert embed_while_generating(alone, TEXTS) == solo
    # prompt chunks of 16 tokens: the long input's rows come over several iterations
    chunked = LLM(model_dir, dtype=dtype, max_batch_tokens=16, max_slots=4)
    assert [o.embedding for o in chunked.embed(TEXTS)] == solo
    assert len(chunked.engine.tokenizer.encode(TEXTS[3])) > 16


def test_pytorch_forward_gives_the_same_vectors_fused(embedder):
    """Without the native step (PyTorch's forward): fused and alone within float32 rounding (its
    kernels are not batch-invariant), the generations unharmed."""
    llm = LLM(embedder("llama", "last"), dtype="float32", native_forward="off")
    solo = torch.tensor([llm.embed(t)[0].embedding for t in TEXTS])
    fused = torch.tensor(embed_while_generating(llm, TEXTS))
    assert (fused - solo).abs().max().item() < 1e-5


def test_pooling_flag_on_a_plain_decoder_and_refusals(make_model):
    plain = make_model("llama")
    with pytest.raises(ValueError, match="--pooling"):
        LLM(plain, dtype="float64").embed("hello")
    llm = LLM(plain, dtype="float64", pooling="last", max_seq_len=64)
    full = llm.embed("the cat sat on the mat")[0].embedding
    assert len(full) == 64 and abs(sum(x * x for x in full) - 1) < 1e-12
    # dimensions: the first so many components, normalized again
    cut = torch.tensor(llm.embed("the cat sat on the mat", dimensions=16)[0].embedding, dtype=torch.float64)
    want = torch.nn.functional.normalize(torch.tensor(full[:16], dtype=torch.float64), dim=0)
    assert cut.shape == (16,) and torch.allclose(cut, want, atol=1e-12)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("x", dimensions=65)
    # longer than the context: refused, or its first tokens when truncation is asked
    ids = list(range(3, 103))
    with pytest.raises(PromptTooLong, match="truncate_prompt_tokens"):
        llm.embed(ids)
    assert llm.embed(ids, truncate_prompt_tokens=40)[0].embedding == llm.embed(ids[:40])[0].embedding
    text = "the cat sat on the mat " * 40
    first = llm.engine.tokenizer.encode(text)[:50]
    assert llm.embed(text, truncate_prompt_tokens=50)[0].embedding == llm.embed(first)[0].embedding
    with pytest.raises(ValueError, match="empty"):
        llm.embed("")
    with pytest.raises(ValueError, match="input 1"):  # nothing of the call is queued
        llm.embed(["fine", [10**6]])
    assert not llm.engine.has_unfinished()
    # a generation in the same engine is unaffected by its embedding requests
    assert llm.generate("hello", SamplingParams(max_new_tokens=4))[0].finish_reason == "length"


def test_a_checkpoints_pooling_config_is_checked(make_model, tmp_path):
    model_dir = as_sentence_transformer(make_model("llama"), tmp_path / "bad", "mean")
    (model_dir / "1_Pooling" / "config.json").write_text('{"pooling_mode_weightedmean_tokens": true}')
    with pytest.raises(CheckpointError, match="one pooling mode"):
        LLM(str(model_dir))
    (model_dir / "modules.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="modules.json"):
        LLM(str(model_dir))


@pytest.mark.parametrize("mode", ["mean", "mean_sqrt_len", "max"])
def test_pooled_rows_are_the_same_bits_however_the_prompt_is_cut(mode):
    """Rows of very different sizes (where float sums depend on their order) fed in different
    chunks give the same vector, and the sentence-transformers value within float64 rounding."""
    scales = torch.logspace(-6, 4, 300, dtype=torch.float64)[:, None]
    rows = torch.randn(300, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * scales
    pooling = Pooling(mode, True, "test")

    def vector(cuts: list[int]) -> torch.Tensor:
        pooled, start = PooledRows(pooling), 0
        for end in [*cuts, rows.shape[0]]:
            pooled.add(rows[start:end])
            start = end
        return pooled.vector()

    whole = vector([])
    for cuts in ([1, 65, 130, 299], [64, 128, 192, 256], [7, 8, 9, 200]):
        assert torch.equal(vector(cuts), whole), cuts
    want = {"mean": rows.mean(0), "mean_sqrt_len": rows.sum(0) / 300**0.5, "max": rows.max(0).values}[mode]
    assert torch.allclose(whole, torch.nn.functional.normalize(want, dim=0), rtol=0, atol=1e-12)
