"""The text half of the engine: each sampled token appended to its request, the finish checks
(stop ids, stop strings, length), incremental text for streams, and the outputs callers see.

A failure that belongs to one request (its text, its sampling) ends that request alone with
finish reason `error`; `on_fail` tells the other tensor-parallel ranks.
"""

from __future__ import annotations

import logging
from typing import Callable

from flover.request import FinishReason, Request, RequestOutput
from flover.runner import Logprob, PromptRows, SampleResult
from flover.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, on_fail: Callable[[str], None] = lambda request_id: None):
        self.tokenizer, self.on_fail = tokenizer, on_fail

    def record(self, sampled: list[Request], result: SampleResult, now: float) -> list[RequestOutput]:
        """Append each request's new token (and those its accepted draft gave), decide whether it
        is finished, and report it. A failure that belongs to one request (its sampling, its
        text) ends that request alone."""
        outputs, logprobs = [], result.logprobs
        for i, (r, token) in enumerate(zip(sampled, result.token_ids)):
            if i in result.failed:
                outputs.append(self.fail(r, result.failed[i], now))
                continue
            try:
                outputs.append(self._record_one(r, [token, *result.accepted.get(i, ())],
                                                logprobs[i] if logprobs is not None else None, now))
            except Exception as e:
                log.exception("request %s failed", r.request_id)
                outputs.append(self.fail(r, f"internal error: {e!r}", now))
        return outputs

    @staticmethod
    def record_prompt_logprobs(scoring: list[PromptRows], found: list[list[Logprob]]) -> None:
        """Each scored prefill chunk's prompt logprobs, appended in prompt order (chunks of one
        prompt come in order, one per iteration)."""
        for rows, entries in zip(scoring, found):
            r, k = rows.request, rows.request.params.top_logprobs
            if not r.prompt_logprobs:
                r.prompt_logprobs.append(None)  # the first token has no context to be predicted from
                r.prompt_top_logprobs.append(None)
            for logprob, alternatives in entries:
                r.prompt_logprobs.append(logprob)
                r.prompt_top_logprobs.append(alternatives[:k])

    def _record_one(self, r: Request, tokens: list[int], logprob: Logprob | None, now: float) -> RequestOutput:
        """`tokens`: one, or (speculation) several in a row, checked one by one: the first that
        finishes the request is its last."""
        if logprob is not None and r.params.logprobs:  # one token: drafts are for requests without logprobs
            r.output_logprobs.append(logprob[0])
            if r.params.top_logprobs:
                r.output_top_logprobs.append(logprob[1][: r.params.top_logprobs])
        if r.timings.first_token is None:
            r.timings.first_token = now
        for n, token in enumerate(tokens, 1):
            r.output_token_ids.append(token)
            delta = r.detokenizer.add(token) if r.detokenizer is not None else ""
            if token in r.stop_token_set:
                r.finish(FinishReason.STOP, now)
            elif delta and r.stop_pattern is not None and self._hit_stop_string(r, delta):
                r.finish(FinishReason.STOP, now)
            elif len(r.output_token_ids) >= r.params.max_new_tokens:
                r.finish(FinishReason.LENGTH, now)
            if r.finished:
                return self.output(r, tokens[:n])
        return self.output(r, tokens)

    def fail(self, r: Request, why: str, now: float) -> RequestOutput:
        """End one request with finish reason `error`; the other ranks retire it with the leader."""
        r.finish(FinishReason.ERROR, now, error=why)
        self.on_fail(r.request_id)
        # Built here rather than by output(): the failure may lie in the text path output() uses.
        return RequestOutput(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, new_token_ids=[],
                             token_ids=list(r.output_token_ids), text=None, finished=True, finish_reason="error",
                             logprobs=None, timings=r.timings.as_dict(len(r.output_token_ids)), error=why,
                             cached_tokens=r.cached_tokens)

    @staticmethod
    def _hit_stop_string(r: Request, delta: str) -> bool:
        """One regex search over the new text and the `stop_holdback` characters before it."""
        text = r.detokenizer.text
        match = r.stop_pattern.search(text, max(0, len(text) - len(delta) - r.stop_holdback))
        if match:
            r.output_text = text[: match.start()]  # the stop string itself is never returned
            return True
        return False

    def output(self, r: Request, new_tokens: list[int]) -> RequestOutput:
        text = None
        if r.finished and self.tokenizer is not None:
            stopped_by_string = r.params.stop and r.finish_reason is FinishReason.STOP \
                and r.output_token_ids and r.output_token_ids[-1] not in r.stop_token_set
            text = r.output_text if stopped_by_string else self.tokenizer.decode(r.output_token_ids)
        return RequestOutput(
            text_delta=self._text_delta(r, text) if r.stream else None,
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, new_token_ids=new_tokens,
            token_ids=list(r.output_token_ids), text=text, finished=r.finished,
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            logprobs=r.output_logprobs if r.params.logprobs else None,
            timings=r.timings.as_dict(len(r.output_token_ids)), error=r.error, cached_tokens=r.cached_tokens,
            top_logprobs=r.output_top_logprobs if r.params.logprobs and r.params.top_logprobs else None,
            **self._prompt_logprobs(r),
        )

    @staticmethod
    def _prompt_logprobs(r: Request) -> dict:
        if not r.params.prompt_logprobs:
            return {}
        if not r.prompt_logprobs:  # a one-token prompt: nothing was scored
            return {"prompt_logprobs": [None], "prompt_top_logprobs": [None]}
        return {"prompt_logprobs": r.prompt_logprobs,
                "prompt_top_logprobs": r.prompt_top_logprobs if r.params.top_logprobs else None}

    @staticmethod
    def _text_delta(r: Request, final_text: str | None) -> str:
        """Text not yet reported. While running, the last (longest stop string - 1) characters
        are held back: they might be the start of a stop string, which is never emitted."""
        if r.finished:
            end = len(final_text or "")
            delta = (final_text or "")[r.emitted:]
        else:
            end = max(r.emitted, len(r.detokenizer.text) - r.stop_holdback)
            delta = r.detokenizer.text[r.emitted:end]
        r.emitted = end
        return delta
