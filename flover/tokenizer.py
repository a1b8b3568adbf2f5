"""Text <-> token ids with the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`)."""

from __future__ import annotations

import json
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
        # The most text one token can stand for (UTF-8 bytes of its vocabulary string, an upper
        # bound for byte-level and sentencepiece vocabularies): a text of B bytes needs at least
        # B / max_token_bytes tokens, which lets a prompt that cannot fit be refused untokenized.
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)),
                                   default=1)
        self.special_tokens, self.chat_template = _tokenizer_config(Path(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """With the tokenizer's own special tokens (e.g. BOS), as transformers' tokenizer(text) does."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict]) -> str:
        """`messages` in the checkpoint's chat template, with the assistant prompt added."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages must be a list of {\"role\": str, \"content\": str}")
        try:
            return self.chat_template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except Exception as e:  # the template's own raise_exception, or a template bug
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Render and tokenize without adding special tokens again, as transformers'
        apply_chat_template does."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

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


def _tokenizer_config(model_dir: Path):
    """Special-token strings and the compiled chat template (tokenizer_config.json or, as
    transformers v5 writes it, chat_template.jinja)."""
    path = model_dir / "tokenizer_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = raw.get(name)
        if isinstance(value, dict):  # AddedToken serialised
            value = value.get("content")
        special[name] = value
    source = raw.get("chat_template")
    jinja_file = model_dir / "chat_template.jinja"
    if source is None and jinja_file.is_file():
        source = jinja_file.read_text()
    if isinstance(source, list):  # named templates: take the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    return special, (_compile_template(source) if source else None)


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
