"""Rerankers: a (query, document) pair read as one input. Cross-encoders (random
BertForSequenceClassification, ms-marco-MiniLM's kind, and XLMRobertaForSequenceClassification,
BGE-reranker's) put its first row through their head; decoder rerankers (Qwen3-Reranker's kind,
sentence-transformers' LogitScore) render it with their chat template and score the last row's
yes / no logits. Both equal sentence-transformers' CrossEncoder in float64; a decoder reranker's
scores ride the fused iterations beside generations bit for bit; long pairs lose document tokens
only when asked; `/v1/rerank` through a real daemon, and two ranks under mpirun."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
import torch

from flover import LLM
from flover.config import SamplingParams
from flover.engine.intake import PromptTooLong
from flover.models.model_config import CheckpointError
from flover.request import EmbedParams, RequestInput
from flover.testing.embedding_model import (
    as_causal_reranker,
    as_logit_score_reranker,
    as_sequence_scorer,
    make_tiny_bert,
    make_tiny_cross_encoder,
    make_tiny_xlm_roberta,
    write_bert_gguf,
    write_qwen3_reranker_gguf,
    write_xlm_roberta_gguf,
)
from tests.helpers import Server, flover_run_ok, free_port, read_records, write_jsonl

QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "the cat sat on the mat",
    "berlin is a city in germany and it is large",
    "Über café: naïve 東京 data",
]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    made = {}

    def make(kind: str, labels: int = 1) -> str:
        if (kind, labels) not in made:
            out = tmp_path_factory.mktemp(f"{kind}-{labels}")
            made[kind, labels] = str(make_tiny_cross_encoder(out, kind, labels))
        return made[kind, labels]

    return make


@pytest.fixture(scope="module")
def decoder_reranker(make_model, tmp_path_factory) -> str:
    """A random Qwen3 as a LogitScore reranker (tokens 100 and 101 stand for "yes" and "no")."""
    return str(as_logit_score_reranker(make_model("qwen3"), tmp_path_factory.mktemp("qwen3-reranker"), 100, 101))


def cross_encoder_reference(model_dir: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """sentence-transformers' scores, a pair at a time (a decoder's batch is left-padded, which
    moves its positions in transformers)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.CrossEncoder(model_dir, device="cpu")
    model.model.to(torch.float64)
    return torch.cat([model.predict([pair], convert_to_tensor=True) for pair in pairs])


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_equal_sentence_transformers(reranker, kind):
    """BERT's pairs carry token type 1 after their first [SEP]; RoBERTa's positions start after the
    padding id: either left out moves every score."""
    model_dir = reranker(kind)
    want = cross_encoder_reference(model_dir, [(QUERY, d) for d in DOCUMENTS])
    got = torch.tensor(LLM(model_dir, dtype="float64").score(QUERY, DOCUMENTS), dtype=torch.float64)
    assert (got - want).abs().max().item() < 1e-9
    single = LLM(model_dir, dtype="float32").score(QUERY, DOCUMENTS)
    assert (torch.tensor(single, dtype=torch.float64) - want).abs().max().item() < 1e-5


def test_a_classifier_of_three_labels_gives_its_logits(reranker):
    """More than one label: no activation (sentence-transformers' default), every label's score."""
    model_dir = reranker("bert", 3)
    want = cross_encoder_reference(model_dir, [(QUERY, d) for d in DOCUMENTS[:2]])
    llm = LLM(model_dir, dtype="float64")
    got = [o.embedding for o in llm.pair_outputs(QUERY, DOCUMENTS[:2])]
    assert (torch.tensor(got, dtype=torch.float64) - want).abs().max().item() < 1e-9
    with pytest.raises(ValueError, match="3 labels"):
        llm.score(QUERY, DOCUMENTS)


def test_pairs_in_one_iteration_score_as_alone(reranker):
    llm = LLM(reranker("bert"), dtype="float64")
    alone = [llm.score(QUERY, d)[0] for d in DOCUMENTS]
    together = llm.score(QUERY, DOCUMENTS * 3)
    assert max(abs(a - b) for a, b in zip(alone * 3, together)) < 1e-12


def test_a_long_pair_loses_document_tokens_only_when_asked(reranker):
    """As transformers' tokenizer(query, document, truncation="only_second", max_length=keep)."""
    import transformers

    model_dir = reranker("bert")
    llm = LLM(model_dir, dtype="float64", max_seq_len=32)
    long_document = " ".join(DOCUMENTS * 4)
    with pytest.raises(PromptTooLong, match="truncate_prompt_tokens"):
        llm.score(QUERY, long_document)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float64)
    encoded = tokenizer(QUERY, long_document, truncation="only_second", max_length=24, return_tensors="pt")
    assert encoded["input_ids"].shape[1] == 24
    want = torch.sigmoid(model(**encoded).logits[0, 0]).item()
    assert abs(llm.score(QUERY, long_document, truncate_prompt_tokens=24)[0] - want) < 1e-9
    with pytest.raises(PromptTooLong, match="the query alone"):
        llm.score(" ".join([QUERY] * 5), "paris", truncate_prompt_tokens=8)


def test_pairs_and_single_inputs_go_to_the_model_made_for_them(reranker, tmp_path):
    """A reranker makes no embeddings, an embedding model scores by cosine similarity."""
    llm = LLM(reranker("bert"), dtype="float64")
    assert llm.engine.capabilities == ["rerank", "score"]
    with pytest.raises(ValueError, match="reranker"):
        llm.embed("paris")
    with pytest.raises(ValueError, match="reranker"):
        LLM(reranker("bert"), dtype="float64", pooling="mean")
    encoder = LLM(str(make_tiny_bert(tmp_path / "bert", "mean")), dtype="float64")
    vectors = torch.tensor([o.embedding for o in encoder.embed([QUERY, *DOCUMENTS])], dtype=torch.float64)
    cosine = torch.nn.functional.cosine_similarity(vectors[1:], vectors[:1])
    assert (torch.tensor(encoder.score(QUERY, DOCUMENTS), dtype=torch.float64) - cosine).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="scored by a reranker"):
        encoder.pair_outputs(QUERY, DOCUMENTS)


def test_a_served_reranker_answers_rerank_and_refuses_embeddings(reranker):
    model_dir = reranker("xlm-roberta")
    port = free_port()
    server = Server(model_dir, "--max-slots", "4", "--max-seq-len", "128", "--http", f"127.0.0.1:{port}")
    try:
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert model["capabilities"] == ["rerank", "score"]
        body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 3, "return_documents": False}
        answer = httpx.post(f"{url}/v1/rerank", json=body, timeout=60).json()
        scores = LLM(model_dir, dtype="float64").score(QUERY, DOCUMENTS)
        want = sorted(range(len(DOCUMENTS)), key=lambda n: -scores[n])[:3]
        assert [r["index"] for r in answer["results"]] == want
        assert max(abs(r["relevance_score"] - scores[r["index"]]) for r in answer["results"]) < 1e-6
        assert "document" not in answer["results"][0] and answer["usage"]["prompt_tokens"] > 0
        refused = httpx.post(f"{url}/v1/embeddings", json={"input": "paris"}, timeout=60)
        assert refused.status_code == 400 and "reranker" in refused.json()["error"]["message"]
        again = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS[:1]}, timeout=60)
        assert again.status_code == 200 and len(again.json()["results"]) == 1
    finally:
        server.stop(signal.SIGKILL)


def test_a_decoder_reranker_equals_sentence_transformers(decoder_reranker):
    """The pair rendered by the chat template as a query and a document message (no assistant
    prompt added), the last row's logit of the true token minus the false one's, then sigmoid."""
    want = cross_encoder_reference(decoder_reranker, [(QUERY, d) for d in DOCUMENTS])
    llm = LLM(decoder_reranker, dtype="float64")
    assert llm.engine.capabilities == ["completion", "chat", "rerank", "score"]
    assert (torch.tensor(llm.score(QUERY, DOCUMENTS), dtype=torch.float64) - want).abs().max().item() < 1e-9
    with pytest.raises(ValueError, match="never cut"):
        llm.score(QUERY, DOCUMENTS[0], truncate_prompt_tokens=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_reranker_scores_beside_generations_are_bit_exact(decoder_reranker, dtype):
    """Pairs and generations in the same fused iterations (the native step): every score is the
    one it gets alone, bit for bit, and every generation the tokens it gets alone."""
    llm = LLM(decoder_reranker, dtype=dtype, max_seq_len=512)
    alone = [llm.score(QUERY, d)[0] for d in DOCUMENTS]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["the river", "a model of the city", "one two three"]
    solo = [llm.generate(p, params)[0].token_ids for p in prompts]
    engine = llm.engine
    ids = [engine.enqueue(engine.make_request(RequestInput(p, params))) for p in prompts]
    ids += [engine.enqueue(engine.make_request(RequestInput(QUERY, embed=EmbedParams(document=d)))) for d in DOCUMENTS]
    finals = {}
    while len(finals) < len(ids):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finals[i].token_ids for i in ids[:3]] == solo
    assert [finals[i].embedding[0] for i in ids[3:]] == alone


def test_a_qwen3_reranker_gguf_file_scores_as_its_directory(decoder_reranker, make_model, tmp_path):
    """llama.cpp's Qwen3-Reranker file (rank pooling; cls.output = the LM head's yes / no rows, the
    untied head itself dropped; its rerank prompt): the pair filled into the prompt, the last row
    through cls.output, the first label's softmax: the LogitScore directory's scores in float64,
    the same bits alone and fused in float32, and no text (the file has no LM head)."""
    gguf_file = str(write_qwen3_reranker_gguf(make_model("qwen3"), tmp_path / "reranker.gguf", 100, 101))
    from_file, from_dir = LLM(gguf_file, dtype="float64"), LLM(decoder_reranker, dtype="float64")
    assert from_file.engine.capabilities == ["rerank", "score"]
    got = torch.tensor(from_file.score(QUERY, DOCUMENTS), dtype=torch.float64)
    assert (got - torch.tensor(from_dir.score(QUERY, DOCUMENTS), dtype=torch.float64)).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="it scores pairs"):
        from_file.generate("hello", SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="is a reranker"):
        from_file.embed("hello")
    fast = LLM(gguf_file, dtype="float32", max_seq_len=512)
    assert fast.score(QUERY, DOCUMENTS) == [fast.score(QUERY, d)[0] for d in DOCUMENTS]
    # a file without its prompt, or with one that has nowhere to put the document, is refused at load
    for n, prompt in enumerate((None, "<Query>: {query}")):
        broken = write_qwen3_reranker_gguf(make_model("qwen3"), tmp_path / f"broken{n}.gguf", 100, 101, prompt)
        with pytest.raises(CheckpointError, match="needs its rerank prompt"):
            LLM(str(broken), dtype="float64")


def test_a_bert_reranker_gguf_file_scores_as_llama_cpp_reads_it(reranker, tmp_path):
    """llama.cpp's converter writes a BERT cross-encoder without its pooler (the classifier as
    cls.output, no pooling type): the [CLS] row straight into the classifier, then sigmoid, the
    document's tokens of type 1 as the tokenizer gives them."""
    import transformers

    model_dir = reranker("bert")
    gguf_file = str(write_bert_gguf(model_dir, tmp_path / "reranker.gguf", None))
    llm = LLM(gguf_file, dtype="float64")
    assert llm.engine.capabilities == ["rerank", "score"]
    model = transformers.BertForSequenceClassification.from_pretrained(model_dir, dtype=torch.float64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    want = []
    for document in DOCUMENTS:
        with torch.no_grad():
            first = model.bert(**tokenizer(QUERY, document, return_tensors="pt")).last_hidden_state[0, 0]
            want.append(torch.sigmoid(model.classifier(first))[0].item())
    got = llm.score(QUERY, DOCUMENTS)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-9


def test_an_xlm_roberta_reranker_gguf_file_scores_as_its_directory(tmp_path):
    """BGE-reranker's kind as llama.cpp's converter writes it (unigram vocabulary as tokenizer
    model t5, the pair as `<s> q </s></s> d </s>`, the head as cls + tanh then cls.output):
    sentence-transformers' scores of the directory, in float64."""
    model_dir = str(make_tiny_xlm_roberta(tmp_path / "bge-reranker", reranker=True))
    gguf_file = str(write_xlm_roberta_gguf(model_dir, tmp_path / "bge-reranker.gguf"))
    want = cross_encoder_reference(model_dir, [(QUERY, d) for d in DOCUMENTS])
    got = torch.tensor(LLM(gguf_file, dtype="float64").score(QUERY, DOCUMENTS), dtype=torch.float64)
    assert (got - want).abs().max().item() < 1e-9


def test_a_decoder_reranker_under_tensor_parallelism_and_in_groups_scores_as_one_rank(decoder_reranker, tmp_path):
    """Two ranks (mpirun): the last rows' logits gathered from both vocabulary halves, the follower
    ending the pairs as the leader does; and two data-parallel groups of one rank, the pairs spread
    over them (`flover run --embed` over lines with a document)."""
    prompts = tmp_path / "pairs.jsonl"
    write_jsonl(prompts, [{"id": str(n), "prompt": QUERY, "document": d} for n, d in enumerate(DOCUMENTS)])
    runs = {"one": (1,), "tp2": (2,), "dp2": (2, "--tp", "1")}
    scores = {}
    for name, (ranks, *flags) in runs.items():
        out = tmp_path / f"{name}.jsonl"
        flover_run_ok(ranks, decoder_reranker, prompts, out, "--embed", "--max-seq-len", "512", *flags)
        scores[name] = {r["id"]: r["embedding"][0] for r in read_records(out)}
    assert scores["one"].keys() == {"0", "1", "2", "3"}
    for name in ("tp2", "dp2"):
        assert scores[name].keys() == scores["one"].keys()
        assert max(abs(scores["one"][k] - scores[name][k]) for k in scores["one"]) < 1e-12, name


def test_a_causal_lm_with_pooling_rank_scores_as_sentence_transformers(make_model, tmp_path):
    """Qwen3-Reranker's uploads (a causal LM, no modules.json): `--pooling rank` reads them as
    sentence-transformers' CrossEncoder does, the last row's "yes" minus "no" logit, sigmoid."""
    model_dir = str(as_causal_reranker(make_model("qwen3"), tmp_path / "qwen3-reranker-upload"))
    want = cross_encoder_reference(model_dir, [(QUERY, d) for d in DOCUMENTS])
    llm = LLM(model_dir, dtype="float64", pooling="rank")
    assert llm.engine.capabilities == ["completion", "chat", "rerank", "score"]
    got = torch.tensor(llm.score(QUERY, DOCUMENTS), dtype=torch.float64)
    assert (got - want).abs().max().item() < 1e-9
    with pytest.raises(ValueError, match="--pooling rank"):  # (without it: a generator)
        LLM(model_dir, dtype="float64").score(QUERY, DOCUMENTS)
    with pytest.raises(CheckpointError, match="no 'yes' or 'no' token"):
        LLM(make_model("qwen3"), pooling="rank")
    # a template that knows only user / assistant would render every pair as nothing
    chat_only = "{% for m in messages %}{% if m.role in ('user', 'assistant') %}{{ m.content }}{% endif %}{% endfor %}"
    config_file = Path(model_dir) / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": chat_only}))
    (Path(model_dir) / "chat_template.jinja").write_text(chat_only)
    with pytest.raises(CheckpointError, match="drops a pair's query and document"):
        LLM(model_dir, pooling="rank")
    with pytest.raises(CheckpointError, match="no LM head"):
        LLM(make_tiny_bert(tmp_path / "bert", "mean"), pooling="rank")


@pytest.mark.parametrize("chat_template", [True, False])
def test_a_decoder_sequence_classifier_scores_as_sentence_transformers(make_model, tmp_path, chat_template):
    """Qwen3-Reranker's seq-cls conversions (Qwen3ForSequenceClassification: a `score` head on the
    last token, no LM head): pairs rendered as sentence-transformers renders them (the chat template's
    query and document messages, else the tokenizer's pair), scores only."""
    model_dir = str(as_sequence_scorer(make_model("qwen3"), tmp_path / "qwen3-seq-cls", chat_template))
    want = cross_encoder_reference(model_dir, [(QUERY, d) for d in DOCUMENTS])
    llm = LLM(model_dir, dtype="float64")
    assert llm.engine.capabilities == ["rerank", "score"]
    got = torch.tensor(llm.score(QUERY, DOCUMENTS), dtype=torch.float64)
    assert (got - want).abs().max().item() < 1e-9
    with pytest.raises(ValueError, match="it scores pairs"):
        llm.generate("hello", SamplingParams(max_new_tokens=2))
    single = LLM(model_dir, dtype="float32")
    fused = single.score(QUERY, DOCUMENTS * 2)
    assert fused == [single.score(QUERY, d)[0] for d in DOCUMENTS] * 2  # (the native step: the same bits)
