"""Text <-> token ids with the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from flover.models.config import CheckpointError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found; pass token ids instead of text, or add the tokenizer")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """With the tokenizer's own special tokens (e.g. BOS), as transformers' tokenizer(text) does."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A token may end in the middle of a multi-byte character; such a delta is held back (it would
    decode to U+FFFD) until the following tokens complete it. Decoding a short window of ids
    rather than the whole output keeps the cost per token constant.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: ids before it are already text
        self._read = 0  # ids before it have produced their text

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix: self._read])
        after = decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
