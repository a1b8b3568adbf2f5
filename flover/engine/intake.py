"""A request's way in, before it is queued: validation, tokenizing, chat rendering, limits, the
grammar of its structured output. One Intake per engine; the daemon's workers, the HTTP front's
/tokenize (through the daemon), prompt files and the offline API all come through it. Nothing
here touches the engine's state, so tokenizing may run on another thread."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Sequence

from flover.config import SamplingParams, int_in
from flover.hardware import return_freed_heap
from flover.models import CheckpointError, ModelConfig
from flover.models.tokenizer import IncrementalDetokenizer, Tokenizer, TooManyTokens
from flover.request import EmbedParams, Request, RequestInput, Timings
from flover.structured.grammars import Grammars
from flover.structured.spec import GrammarLimits

log = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """prompt + max_new_tokens does not fit in max_seq_len (refused, never truncated)."""


# a text to be truncated (truncate_prompt_tokens) is tokenized whole up to this many times max_seq_len
# tokens' worth of bytes: the bound on the tokenizer work one truncated input can cost
TRUNCATED_TEXT_CONTEXTS = 4


class Intake:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        model_config: ModelConfig,
        max_seq_len: int,
        grammar_limits: GrammarLimits,
        checks_grammars: bool,
        refuse_over_context: bool = True,
    ):
        """`checks_grammars`: try each new grammar in a child process first (grammar_sandbox.py;
        the leader of the engine does, a data-parallel group's leader need not).
        `refuse_over_context`: a text of more tokens than max_seq_len is PromptTooLong (requests);
        else it is tokenized whole (the HTTP front's /tokenize counts it), as long as it could fit
        by its size at all (Tokenizer.cannot_fit: the bound on the work either way)."""
        self.tokenizer, self.model_config, self.max_seq_len = tokenizer, model_config, max_seq_len
        self.grammar_limits, self.checks_grammars = grammar_limits, checks_grammars
        self.refuse_over_context = refuse_over_context
        self._grammars: Grammars | None = None
        # a reranker's (query, document) pairs (the engine sets it from the model's pooling): "tokenizer"
        # (a cross-encoder's, joined as its tokenizer joins a pair), "template" (a decoder's, rendered by its
        # chat template as a query and a document message); None: the model takes no pairs
        self.pairs: str | None = None
        self.pair_template: str | None = None  # a reranker GGUF file's prompt ({query}, {document})
        self.scores_only = False  # the model's files hold no LM head (a reranker's GGUF file or seq-cls): no text
        self.vector_width = model_config.hidden_size  # of its vectors (the engine sets it after Dense modules)

    def build(self, request_id: str, given: RequestInput) -> Request:
        """Validate and tokenize `given` under `request_id`; raises ValueError naming what is
        wrong. Queues nothing."""
        if given.embed is not None:
            return self._embed_request(request_id, given)
        params, stream, arrival_time = given.params, given.stream, given.arrival_time
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        tokenized = given.tokenized
        token_ids, text = tokenized if tokenized is not None else self.tokenize(given.prompt, given.messages)
        limit = self.max_seq_len
        if params.max_new_tokens is None:  # the rest of the context (OpenAI's chat default)
            params = params.with_updates(max_new_tokens=max(1, limit - len(token_ids)))
        if len(token_ids) + params.max_new_tokens > limit:
            raise PromptTooLong(
                f"prompt of {len(token_ids)} tokens + max_new_tokens={params.max_new_tokens} "
                f"exceeds max_seq_len={limit}; shorten the prompt or lower max_new_tokens"
            )
        if (params.stop or stream) and self.tokenizer is None:
            raise ValueError("stop strings and streamed text need the checkpoint's tokenizer")
        if any(token >= self.model_config.vocab_size for token, _ in params.logit_bias):
            raise ValueError(
                f"SamplingParams.logit_bias: token ids must be below the vocabulary size {self.model_config.vocab_size}"
            )
        eos = params.eos_token_ids if params.eos_token_ids is not None else self.model_config.eos_token_ids
        grammar = self.grammars.start(params.structured) if params.structured is not None else None
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            prompt=text,
            stop_token_set=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos)),
            detokenizer=IncrementalDetokenizer(self.tokenizer) if params.stop or stream else None,
            stream=stream,
            timings=Timings(arrival=time.perf_counter() if arrival_time is None else arrival_time),
            cache_salt=given.cache_salt,
            grammar=grammar,
        )
        if params.stop:
            request.stop_pattern = re.compile("|".join(map(re.escape, params.stop)))
            request.stop_holdback = max(map(len, params.stop)) - 1
        return request

    def _embed_request(self, request_id: str, given: RequestInput) -> Request:
        """An embedding input: text (special tokens added, as sentence-transformers' tokenizer
        call does) or token ids, never a chat; longer than max_seq_len only when truncation is
        asked. A cross-encoder's: a (query, document) pair of texts, joined by its tokenizer."""
        embed, limit = given.embed, self.max_seq_len
        if given.messages is not None or given.params is not None or given.stream:
            raise ValueError("an embedding input is a text or token ids: no messages, sampling or streaming")
        keep = embed.truncate_prompt_tokens
        if keep is not None and not int_in(keep, 1, limit):
            raise ValueError(f"truncate_prompt_tokens={keep!r}: must be an integer in [1, max_seq_len={limit}]")
        self._check_pairing(embed)
        dims, width = embed.dimensions, self.vector_width
        if dims is not None and not int_in(dims, 1, width):
            raise ValueError(f"dimensions={dims!r}: must be an integer in [1, {width}] (the model's vectors')")
        if embed.pair and embed.document is None:  # joined already (the leader's pair, on a follower rank)
            token_ids, text, second = self._prompt_ids(given.prompt)[0], None, embed.second_segment
        else:
            tokenized = given.tokenized or self.input_ids(given.prompt, keep, embed.document)
            token_ids, text, second = tokenized if len(tokenized) == 3 else (*tokenized, None)
        token_ids = token_ids[:keep] if keep is not None else token_ids
        if len(token_ids) > limit:
            raise PromptTooLong(
                f"input of {len(token_ids)} tokens exceeds max_seq_len={limit}; "
                f"truncate_prompt_tokens keeps its first tokens"
            )
        arrival = time.perf_counter() if given.arrival_time is None else given.arrival_time
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=SamplingParams(max_new_tokens=1),
            prompt=text,
            timings=Timings(arrival=arrival),
            cache_salt=given.cache_salt,
            embed=dataclasses.replace(
                embed, document=None, pair=embed.pair or embed.document is not None, second_segment=second
            ),
        )

    def _check_pairing(self, embed: EmbedParams) -> None:
        """A cross-encoder takes pairs and only pairs; a pair has no dimensions to cut."""
        if self.pairs is not None:
            if embed.document is None and not embed.pair:
                raise ValueError(
                    f"{self.model_config.architecture} is a reranker: it scores (query, document) pairs "
                    "(rerank, score), it makes no embeddings"
                )
            if embed.document is not None and (not isinstance(embed.document, str) or not embed.document):
                raise ValueError("a pair's document is a non-empty text")
            if embed.dimensions is not None:
                raise ValueError("dimensions: a reranker's scores are not cut")
        elif embed.document is not None or embed.pair:
            raise ValueError("a (query, document) pair is scored by a reranker (a cross-encoder); this model embeds")

    def input_ids(self, prompt, keep: int | None = None, document: str | None = None):
        """An embedding input's (token ids, its text if it came as text, where a pair's second
        part begins or None): special tokens added; `keep`: the first so many of a longer input
        (None: longer than max_seq_len is refused); `document`: the input is a (prompt, document)
        pair, and a pair longer than `keep` loses the document's last tokens."""
        if document is not None:
            return self._pair_ids(prompt, document, keep)
        if keep is not None:
            return (*self._truncated_ids(prompt, keep), None)
        try:
            return (*self._prompt_ids(prompt), None)
        except PromptTooLong as e:
            raise PromptTooLong(f"{e}; truncate_prompt_tokens keeps an input's first tokens") from None

    def _truncated_ids(self, prompt, keep: int) -> tuple[list[int], str | None]:
        """The first `keep` tokens of an input that may be longer than max_seq_len."""
        if isinstance(prompt, (list, tuple)):
            return self._prompt_ids(list(prompt[:keep]))
        if not isinstance(prompt, str):
            return self._prompt_ids(prompt)  # (names what is wrong)
        if self.tokenizer is None:
            raise ValueError("text inputs need the checkpoint's tokenizer; pass token ids")
        if self.tokenizer.cannot_fit(prompt, TRUNCATED_TEXT_CONTEXTS * self.max_seq_len):
            raise PromptTooLong(
                f"input of {len(prompt.encode('utf-8', 'surrogatepass'))} bytes: truncated inputs are read up "
                f"to {TRUNCATED_TEXT_CONTEXTS} x max_seq_len={self.max_seq_len} tokens' worth of text"
            )
        ids = self._checked(self.tokenizer.encode(prompt, True))
        if not ids:
            raise ValueError("the input is empty")
        return ids[:keep], prompt

    def _pair_ids(self, query, document: str, keep: int | None) -> tuple[list[int], str, int | None]:
        if not isinstance(query, str) or not query or not isinstance(document, str) or not document:
            raise ValueError("a pair is two non-empty texts: a query and a document")
        if self.tokenizer is None:
            raise ValueError("pairs need the checkpoint's tokenizer")
        if self.pairs == "template":
            return self._rendered_pair(query, document, keep)
        contexts = 1 if keep is None else TRUNCATED_TEXT_CONTEXTS
        if self.tokenizer.cannot_fit(query + document, contexts * self.max_seq_len):
            raise PromptTooLong(
                f"pair of {len((query + document).encode('utf-8', 'surrogatepass'))} bytes cannot fit in "
                f"{contexts} x max_seq_len={self.max_seq_len} tokens"
            )
        try:
            ids, types = self.tokenizer.encode_pair(query, document, keep)
        except TooManyTokens as e:
            raise PromptTooLong(f"the query alone takes {e.count} of truncate_prompt_tokens={keep}") from None
        second = types.index(1) if 1 in types and self.model_config.token_types > 1 else None
        return self._checked(ids), query, second

    def check_pair_template(self) -> None:
        """CheckpointError unless the chat template carries a (query, document) pair: rendered with
        another query, and with another document, the text must change (sentence-transformers
        probes the same way; a template that knows only user / assistant renders a pair to
        nothing, and the model would score an empty prompt)."""
        probes = [("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot")]
        try:
            base, *varied = [self._render_pair(q, d, 1 << 20) for q, d in probes]
        except ValueError as e:
            raise CheckpointError(f"a reranker's chat template cannot render a (query, document) pair: {e}") from None
        dropped = [role for role, text in zip(("query", "document"), varied) if text == base]
        if dropped:
            raise CheckpointError(
                f"the chat template drops a pair's {' and '.join(dropped)}: a reranker's template renders "
                "a 'query' and a 'document' message (as Qwen3-Reranker's does)"
            )

    def _render_pair(self, query: str, document: str, max_bytes: int) -> str:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        return self.tokenizer.render_chat(messages, None, {"add_generation_prompt": False}, max_bytes=max_bytes)

    def _rendered_pair(self, query: str, document: str, keep: int | None) -> tuple[list[int], str, None]:
        """A decoder reranker's pair: its chat template's rendering of a query and a document
        message (no assistant prompt added, as sentence-transformers renders it), or its GGUF
        file's rerank prompt filled in (as llama-server fills it). Never cut: the template's end
        is what the model answers after."""
        if keep is not None:
            raise ValueError("truncate_prompt_tokens: a decoder reranker's pair is never cut (its template ends it)")
        self._check_text_size(query + document)
        if self.pair_template is not None:  # (llama.cpp's rerank prompt: each placeholder replaced once over)
            given = {"{query}": query, "{document}": document}
            text = re.sub(r"\{query\}|\{document\}", lambda m: given[m.group(0)], self.pair_template)
        else:
            text = self._render_pair(query, document, self.max_seq_len * self.tokenizer.max_token_bytes)
        self._check_text_size(text)
        return self._checked(self._encode(text, False)), query, None

    @property
    def grammars(self) -> Grammars:
        """This model's structured-output grammars (built on the first request that has one)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the checkpoint's tokenizer")
            # the leader tries each new grammar in a child process first (grammar_sandbox.py)
            self._grammars = Grammars(
                self.tokenizer,
                self.model_config.vocab_size,
                self.model_config.eos_token_ids,
                self.grammar_limits,
                sandboxed=self.checks_grammars,
            )
        return self._grammars

    def prepare_grammars(self, checked_elsewhere: bool = False) -> None:
        """Build llguidance's view of the tokenizer now (~0.15 s for 49k tokens, holding the
        GIL): a server's first structured request would otherwise stall every running one; and
        start the child that tries new grammars first, unless they are `checked_elsewhere` (a
        data-parallel group's leader: world rank 0 tried each one before routing it); and compile the
        chat template in its child (flover/chat_template.py), so that the first chat does not wait."""
        if self.tokenizer is not None:
            self.checks_grammars = self.checks_grammars and not checked_elsewhere
            if self.checks_grammars:  # (the rank that checks grammars renders the chats: the first leader)
                self.tokenizer.start_chat_template()
            try:
                if self.grammars.sandbox is not None:
                    self.grammars.sandbox.start()  # (its tokenizer is built while nothing runs yet)
            except Exception as e:  # a structured request will name it; the rest is unaffected
                log.warning("structured output unavailable: %s", e)
            return_freed_heap()  # parsing the tokenizer's JSON for it left tens of MiB freed

    def tokenize(
        self,
        prompt: str | Sequence[int] | None,
        messages: list | None = None,
        tools: list | None = None,
        special: bool = True,
        template_kwargs: dict | None = None,
    ) -> tuple[list[int], str | None]:
        """(the prompt's token ids, its text if it came as text); ValueError naming what is wrong.
        `tools`: OpenAI's, with `messages`, for the chat template. `special`: a text prompt's
        special tokens (BOS) added as the tokenizer says. Touches no engine state, so it may run
        on another thread. `template_kwargs`: more variables for the chat template."""
        if messages is not None:
            return self._chat_ids(messages, tools, template_kwargs), None
        return self._prompt_ids(prompt, special)

    def _prompt_ids(self, prompt, special: bool = True) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need the checkpoint's tokenizer; pass token ids")
            self._check_text_size(prompt)
            ids = self._checked(self._encode(prompt, special))
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            if len(prompt) > self.max_seq_len:  # before looking at a million ids one by one
                raise PromptTooLong(f"prompt of {len(prompt)} tokens exceeds max_seq_len={self.max_seq_len}")
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        else:
            raise ValueError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids, text

    def _check_text_size(self, text: str) -> None:
        """Refuse, without tokenizing it, a text that cannot fit (Tokenizer.cannot_fit): bounds the
        tokenizer work one request can cost."""
        if self.tokenizer.cannot_fit(text, self.max_seq_len):
            size = len(text.encode("utf-8", "surrogatepass"))
            longest = self.tokenizer.max_token_bytes
            raise PromptTooLong(
                f"prompt of {size} bytes cannot fit in max_seq_len={self.max_seq_len} tokens "
                f"(no token is longer than {longest} bytes); refused before tokenizing"
            )

    def _chat_ids(self, messages: list, tools: list | None = None, template_kwargs: dict | None = None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("messages need the checkpoint's tokenizer")
        if isinstance(messages, list):  # refused before rendering when the contents alone cannot fit
            self._check_text_size(
                "".join(m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
            )
        # (a text longer than any that could fit is refused in the template's child, not sent back)
        fits = self.max_seq_len * self.tokenizer.max_token_bytes
        text = self.tokenizer.render_chat(messages, tools, template_kwargs, max_bytes=fits)
        self._check_text_size(text)
        ids = self._checked(self._encode(text, False))
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def _encode(self, text: str, special: bool) -> list[int]:
        try:
            return self.tokenizer.encode(
                text, special, max_tokens=self.max_seq_len if self.refuse_over_context else None
            )
        except TooManyTokens as e:
            raise PromptTooLong(f"prompt of {e.count} tokens exceeds max_seq_len={self.max_seq_len}") from None

    def _checked(self, ids: list[int]) -> list[int]:
        """The tokenizer's ids, which a careless checkpoint may let outside the model's vocabulary."""
        vocab, largest = self.model_config.vocab_size, max(ids, default=-1)
        if largest >= vocab:
            raise ValueError(
                f"the tokenizer gave token id {largest}, outside the model's vocabulary of {vocab}: "
                f"the checkpoint's tokenizer does not match its model"
            )
        return ids

    def close(self) -> None:
        """End the grammar checker's and the chat template's child processes, if they started."""
        if self._grammars is not None:
            self._grammars.close()
        if self.tokenizer is not None:
            self.tokenizer.close()
