"""The text half of the engine: the new tokens of each request (the scheduler appended them)
through its detokenizer, stop strings (one may end a request before tokens the scheduler
appended after it, which are then taken back), incremental text for streams, and the outputs
callers see.

A failure that belongs to one request (its text, its sampling) ends that request alone with
finish reason `error`; `on_fail` tells the other tensor-parallel ranks.
"""

from __future__ import annotations

import logging
from typing import Callable

from flover.models.tokenizer import Tokenizer
from flover.request import FinishReason, NewTokens, Request, RequestOutput

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, on_fail: Callable[[str], None] = lambda request_id: None):
        self.tokenizer, self.on_fail = tokenizer, on_fail

    def emit(self, updates: list[NewTokens], now: float) -> list[RequestOutput]:
        """One output per request the iteration gave tokens to (or whose sampling failed)."""
        outputs = []
        for update in updates:
            r = update.request
            if r.finish_reason is FinishReason.ERROR:  # its sampling failed (the scheduler ended it)
                outputs.append(self.fail(r, r.error, now, r.error_code))
                continue
            try:
                outputs.append(self._text(r, update.tokens, now))
            except Exception as e:
                log.exception("request %s failed", r.request_id)
                outputs.append(self.fail(r, f"internal error: {e!r}", now))
        return outputs

    def _text(self, r: Request, tokens: list[int], now: float) -> RequestOutput:
        """`tokens`: one, or (speculation) several in a row, each through the detokenizer; the
        first whose text completes a stop string is the request's last."""
        for n, token in enumerate(tokens, 1):
            delta = r.detokenizer.add(token) if r.detokenizer is not None else ""
            if (
                token not in r.stop_token_set
                and delta
                and r.stop_pattern is not None
                and self._hit_stop_string(r, delta)
            ):
                del r.output_token_ids[len(r.output_token_ids) - len(tokens) + n :]  # those after it
                r.finish(FinishReason.STOP, now)
                return self.output(r, tokens[:n])
        return self.output(r, tokens)

    def fail(self, r: Request, why: str, now: float, code: str | None = None) -> RequestOutput:
        """End one request with finish reason `error`; the other ranks retire it with the leader."""
        r.finish(FinishReason.ERROR, now, error=why, code=code)
        self.on_fail(r.request_id)
        # Built here rather than by output(): the failure may lie in the text path output() uses.
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            new_token_ids=[],
            token_ids=list(r.output_token_ids),
            text=None,
            finished=True,
            finish_reason="error",
            logprobs=None,
            timings=r.timings.as_dict(len(r.output_token_ids)),
            error=why,
            error_code=code,
            cached_tokens=r.cached_tokens,
        )

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
        if r.finished and self.tokenizer is not None and r.embed is None:
            stopped_by_string = (
                r.params.stop
                and r.finish_reason is FinishReason.STOP
                and r.output_token_ids
                and r.output_token_ids[-1] not in r.stop_token_set
            )
            text = r.output_text if stopped_by_string else self.tokenizer.decode(r.output_token_ids)
        return RequestOutput(
            text_delta=self._text_delta(r, text) if r.stream else None,
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            new_token_ids=new_tokens,
            token_ids=list(r.output_token_ids),
            text=text,
            finished=r.finished,
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            logprobs=r.output_logprobs if r.params.logprobs else None,
            timings=r.timings.as_dict(len(r.output_token_ids)),
            error=r.error,
            error_code=r.error_code,
            cached_tokens=r.cached_tokens,
            embedding=r.embedding,
            top_logprobs=r.output_top_logprobs if r.params.logprobs and r.params.top_logprobs else None,
            **self._prompt_logprobs(r),
        )

    @staticmethod
    def _prompt_logprobs(r: Request) -> dict:
        if not r.params.prompt_logprobs:
            return {}
        if not r.prompt_logprobs:  # a one-token prompt: nothing was scored
            return {"prompt_logprobs": [None], "prompt_top_logprobs": [None]}
        return {
            "prompt_logprobs": r.prompt_logprobs,
            "prompt_top_logprobs": r.prompt_top_logprobs if r.params.top_logprobs else None,
        }

    @staticmethod
    def _text_delta(r: Request, final_text: str | None) -> str:
        """Text not yet reported. While running, the last (longest stop string - 1) characters
        are held back: they might be the start of a stop string, which is never emitted."""
        if r.finished:
            end = len(final_text or "")
            delta = (final_text or "")[r.emitted :]
        else:
            end = max(r.emitted, len(r.detokenizer.text) - r.stop_holdback)
            delta = r.detokenizer.text[r.emitted : end]
        r.emitted = end
        return delta
