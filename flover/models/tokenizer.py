"""Text <-> token ids (Hugging Face `tokenizers`): from a checkpoint directory's `tokenizer.json`,
or built from a GGUF file's vocabulary and merges (`tokenizer.ggml.*`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from flover.chat_template import TemplateLimits, TemplateSandbox, parse_template
from flover.models.gguf_file import GGUFFile, GGUFTokenizerSpec
from flover.models.model_config import CheckpointError
from flover.reasoning import speaks_harmony, visible_special_tokens
from flover.tools import prompt_messages

# tokenizer.ggml.pre -> the split regex the merges were learned with (as transformers' GGUF
# conversion and llama.cpp use them); absent: GPT-2's own (ByteLevel's built-in regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
log = logging.getLogger(__name__)
DIGITS_ALONE = ("smollm",)  # llama.cpp splits every digit first (as SmolLM's own tokenizer.json does)


class TooManyTokens(ValueError):
    def __init__(self, count: int):
        super().__init__(f"{count} tokens")
        self.count = count


class Tokenizer:
    def __init__(self, backend: HFTokenizer, special_tokens: dict, chat_template, where: str = "the checkpoint"):
        """`chat_template`: its source as the file holds it (a string; anything else turns chat off,
        named with `where`, the file and field it came from)."""
        backend.no_padding()  # (a tokenizer.json may pad or cut every text: flover refuses, never cuts silently)
        backend.no_truncation()
        self._tok = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # The most text one token can stand for (UTF-8 bytes of its vocabulary string, an upper
        # bound for byte-level and sentencepiece vocabularies): a text of B bytes needs at least
        # B / max_token_bytes tokens, which lets a prompt that cannot fit be refused untokenized.
        self.max_token_bytes = max(
            (len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True)), default=1
        )
        if isinstance(backend.model, models.WordPiece):  # (one [UNK] stands for a whole word up to this long)
            self.max_token_bytes = max(self.max_token_bytes, 4 * backend.model.max_input_chars_per_word)
        self.special_tokens = special_tokens
        self.chat_template: TemplateSandbox | None = None  # compiled and rendered in a bounded child
        chat_template, self.chat_template_error = _template_text(chat_template, where)
        self.chat_template_source = chat_template  # its text: which tool-call syntax the model writes
        self.keeps_special = speaks_harmony(chat_template)  # (decode keeps its channels)
        # (Gemma 4) the special tokens its answers are parsed by, kept; the other special ids, dropped
        visible = visible_special_tokens(chat_template)
        added = backend.get_added_tokens_decoder()
        self._hidden_special = (
            {i for i, t in added.items() if t.special and t.content not in visible} if visible else None
        )
        if chat_template:
            try:
                parse_template(chat_template)  # (its syntax here; compiling it is the child's)
                self.chat_template = TemplateSandbox(chat_template)
            except Exception as e:  # a template that does not parse disables chat, not the model
                self.chat_template_error = f"{type(e).__name__}: {e}"
        if self.chat_template_error is not None:
            log.warning("the chat template is unusable (%s): chat is off, plain prompts work", self.chat_template_error)
        # Byte-level vocabularies spell each byte as one printable character (GPT-2's table).
        self._byte_of = (
            {c: b for b, c in _bytes_to_unicode().items()} if isinstance(backend.decoder, decoders.ByteLevel) else None
        )

    @classmethod
    def from_directory(cls, model_dir: str | Path) -> "Tokenizer":
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found; pass token ids instead of text, or add the tokenizer")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        special, template, where = _tokenizer_config(Path(model_dir))
        return cls(backend, special, template, where)

    @classmethod
    def from_gguf(cls, spec: GGUFTokenizerSpec, where: str = "GGUF") -> "Tokenizer":
        builders = {"gpt2": _byte_level_bpe, "gemma4": _spm_style_bpe, "bert": _wordpiece, "t5": _unigram}
        if spec.model not in builders:
            raise CheckpointError(
                f"{where}: tokenizer model {spec.model!r} is not supported yet (flover builds "
                f"tokenizer.ggml.model {' and '.join(map(repr, builders))})"
            )
        backend = builders[spec.model](spec)
        name = lambda i: spec.tokens[i] if i is not None and 0 <= i < len(spec.tokens) else None  # noqa: E731
        special = {
            "bos_token": name(spec.bos_token_id),
            "eos_token": name(spec.eos_token_id),
            "unk_token": None,
            "pad_token": None,
        }
        eos = special["eos_token"] if spec.add_eos else None  # (BERT's [SEP] after the text)
        if spec.add_bos and special["bos_token"]:
            bos = special["bos_token"]
            ends = [(bos, spec.bos_token_id)] + ([(eos, spec.eos_token_id)] if eos and eos != bos else [])
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A" + (f" {eos}" if eos else ""),
                pair=_pair_template(spec, bos, eos),
                special_tokens=ends,
            )
        return cls(backend, special, spec.chat_template, f"{where}: tokenizer.chat_template")

    def cannot_fit(self, text: str, max_tokens: int) -> bool:
        """True when `text` surely needs more than `max_tokens` tokens: at least bytes / (longest
        token in bytes). Found without tokenizing, so a text far too long costs no tokenizer work."""
        return len(text.encode("utf-8", "surrogatepass")) > max_tokens * self.max_token_bytes

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """With the tokenizer's own special tokens (e.g. BOS), as transformers' tokenizer(text) does.
        (`encode_batch` of one: unlike `encode`, it releases the GIL while it works, so a long text
        tokenized on a worker thread does not stop the engine loop.) Beyond `max_tokens` tokens:
        TooManyTokens, before the ids become a Python list."""
        encoding = _unpanicked(lambda: self._tok.encode_batch([text], add_special_tokens=add_special_tokens))[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding))
        return encoding.ids

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled `token` (as transformers' convert_tokens_to_ids), or None."""
        return self._tok.token_to_id(token)

    def encode_pair(self, first: str, second: str, keep: int | None = None) -> tuple[list[int], list[int]]:
        """Two texts as one input, joined as the tokenizer joins a pair (BERT's [CLS] a [SEP] b
        [SEP]; transformers' tokenizer(a, b)): its ids and token types. `keep`: at most so many
        tokens, the second text's last ones dropped (TooManyTokens when the first leaves none)."""
        a, b = _unpanicked(lambda: self._tok.encode_batch([first, second], add_special_tokens=False))
        if keep is not None:
            room = keep - len(a) - self._tok.num_special_tokens_to_add(True)
            if room < 1:
                raise TooManyTokens(len(a))
            b.truncate(room)
        pair = self._tok.post_process(a, b, add_special_tokens=True)
        return pair.ids, pair.type_ids

    def set_template_limits(self, limits: TemplateLimits) -> None:
        """What rendering one chat may cost (before the first chat)."""
        if self.chat_template is not None:
            self.chat_template = TemplateSandbox(self.chat_template_source, limits)

    def start_chat_template(self) -> None:
        """Start the chat template's child now, compiling it (a server, before it serves)."""
        if self.chat_template is not None:
            self.chat_template.start()

    def close(self) -> None:
        """End the chat template's child process, if one started."""
        if self.chat_template is not None:
            self.chat_template.close()

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        max_bytes: int = 1 << 30,
    ) -> str:
        """`messages` in the checkpoint's chat template, with the assistant prompt added; with
        `tools` (OpenAI's), or earlier calls and results among the messages, as flover/tools.py
        puts them for this template. `template_kwargs`: more variables for the template (e.g.
        Qwen3's enable_thinking; checked by protocol.check_template_kwargs). Rendered in a child
        within its limits (flover/chat_template.py); a text over `max_bytes` is refused there."""
        if self.chat_template_error is not None:
            raise ValueError(
                f"this checkpoint's chat template is broken ({self.chat_template_error}); "
                f"chat is off, send a plain prompt instead"
            )
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not all(map(_chat_message, messages)):
            raise ValueError(
                'messages must be a list of {"role": str, "content": str} (an assistant\'s '
                "may carry tool_calls, a tool's its tool_call_id)"
            )
        extra = {}
        if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages, extra = prompt_messages(messages, tools, self.chat_template_source)
        variables = {**(template_kwargs or {}), **self.special_tokens, **extra}
        return self.chat_template.render({"messages": messages, "add_generation_prompt": True, **variables}, max_bytes)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render and tokenize without adding special tokens again, as transformers'
        apply_chat_template does."""
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as its JSON (what llguidance builds its own view from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special tokens left out, but for a chat template in gpt-oss's harmony
        format, whose channels are special tokens (flover/reasoning.py parses them), and Gemma 4's
        thinking channel and tool-call tokens."""
        ids = [i for i in ids if i < self.vocab_size]
        if self._hidden_special is not None:  # (Gemma 4: its thinking channel's and tool calls' tokens kept)
            return self._tok.decode([i for i in ids if i not in self._hidden_special], skip_special_tokens=False)
        return self._tok.decode(ids, skip_special_tokens=not self.keeps_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for — possibly part of a multi-byte character — as the
        OpenAI API reports them next to a token's logprob; special tokens as spelled."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_of is not None and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _chat_message(m) -> bool:
    """A chat message's shape: role and text content; an assistant's tool calls (OpenAI's
    {"id", "type": "function", "function": {"name", "arguments"}}), a tool result's call id."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), (str, dict))
            for c in calls
        ):
            return False
        return m.get("content") is None or isinstance(m.get("content"), str)
    return isinstance(m.get("content"), str) and isinstance(m.get("tool_call_id", ""), str)


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
        before = decode(self.ids[self._prefix : self._read])
        after = decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def load_tokenizer(checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has none (token ids only)."""
    if isinstance(checkpoint, GGUFFile):
        spec = checkpoint.tokenizer_spec()
        return None if spec is None else Tokenizer.from_gguf(spec, str(checkpoint.path))
    return Tokenizer.from_directory(checkpoint.path) if (checkpoint.path / "tokenizer.json").is_file() else None


def _byte_level_bpe(spec: GGUFTokenizerSpec) -> HFTokenizer:
    """GPT-2 style byte-level BPE from the vocabulary and merges, with the file's control tokens
    (type 3) as special tokens and its user-defined ones (type 4) as added tokens, as transformers'
    GGUF conversion builds it."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(spec.tokens)
    }
    merges = [tuple(m.split(" ")) for m in spec.merges]
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = SPLITS.get(spec.pre)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif spec.pre in DIGITS_ALONE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(spec.tokens, spec.token_types)
        if kind == 3 and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(spec.tokens, spec.token_types)
        if kind == 4 and t in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    return backend


def _spm_style_bpe(spec: GGUFTokenizerSpec) -> HFTokenizer:
    """Gemma 4's tokenizer ("gemma4"): BPE over raw UTF-8 with spaces spelled U+2581 and bytes
    the vocabulary lacks as <0xNN> tokens, split only at newlines, as llama.cpp reads it; the
    file's control tokens special, its user-defined ones added."""
    vocab = {t: i for i, t in enumerate(spec.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, byte_fallback=True, fuse_unk=False))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(spec.tokens, spec.token_types) if kind == 3]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, kind in zip(spec.tokens, spec.token_types) if kind == 4]
    )
    return backend


PROBE_TEXT = "Aa 1 \u00e9\u00df \u6771\u4eac \U0001f642\t\u2581"  # (a vocabulary's normalization tried at load)


def _unpanicked(call):
    """`call()`, where tokenizers' Rust code may panic (pyo3's PanicException, a BaseException: a
    malformed vocabulary, or a text it cannot handle): then a ValueError, one text's failure."""
    try:
        return call()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise ValueError(f"the tokenizer failed on this text ({str(e)[:200]})") from None


def _pair_template(spec: GGUFTokenizerSpec, bos: str, eos: str | None) -> str:
    """How a pair is joined: BERT's `[CLS] a [SEP] b [SEP]` (b of token type 1), XLM-RoBERTa's
    `<s> a </s></s> b </s>` (a unigram vocabulary with add_sep), or `bos a bos b`."""
    if eos is None:
        return f"{bos} $A {bos} $B"
    if spec.model == "t5" and spec.add_sep:
        return f"{bos} $A {eos} {eos} $B {eos}"
    return f"{bos} $A {eos} $B:1 {eos}:1"


def _unigram(spec: GGUFTokenizerSpec) -> HFTokenizer:
    """SentencePiece's unigram model ("t5": XLM-RoBERTa's, BGE-M3's), as llama.cpp reads it: the
    pieces and their scores, the file's precompiled normalization (if any), spaces merged and the
    text's ends stripped where it says so, each word marked with U+2581 (a first one too, where
    add_space_prefix); control tokens special, user-defined ones added."""
    if spec.scores is None or len(spec.scores) != len(spec.tokens):
        raise CheckpointError("a unigram vocabulary (tokenizer model t5) needs a score for each token")
    unknown = spec.unknown_token_id
    if unknown is None:
        unknown = next((i for i, kind in enumerate(spec.token_types) if kind == 2), None)
    if unknown is not None and not 0 <= unknown < len(spec.tokens):
        raise CheckpointError(f"the unknown token id {unknown} is outside the vocabulary ({len(spec.tokens)})")
    try:  # (a malformed vocabulary or charsmap is input: tokenizers' errors, or its panics on a first text)
        backend = HFTokenizer(models.Unigram(list(zip(spec.tokens, map(float, spec.scores))), unknown, False))
        steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
        _unpanicked(lambda: [step.normalize_str(PROBE_TEXT) for step in steps])
    except Exception as e:
        raise CheckpointError(f"an unreadable unigram vocabulary or precompiled charsmap ({e})") from None
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    backend.normalizer = normalizers.Sequence(steps)
    prefix = "always" if spec.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prefix)
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prefix)
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(spec.tokens, spec.token_types) if kind == 3]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, kind in zip(spec.tokens, spec.token_types) if kind == 4]
    )
    return backend


def _wordpiece(spec: GGUFTokenizerSpec) -> HFTokenizer:
    """BERT's WordPiece ("bert"), as llama.cpp's converter stores it: a word's first piece spelled
    with a leading U+2581, a continuation without (HF's "##" prefix taken off), control tokens as
    they are; normalized and split as BertNormalizer / BertPreTokenizer do (lowercased where the
    file says, accents then stripped)."""
    vocab = {}
    for i, (t, kind) in enumerate(zip(spec.tokens, spec.token_types)):
        word = t if kind == 3 else t[1:] if t.startswith("\u2581") else "##" + t
        vocab.setdefault(word, i)
    unk = spec.tokens[spec.unknown_token_id] if spec.unknown_token_id is not None else "[UNK]"
    backend = HFTokenizer(models.WordPiece(vocab=vocab, unk_token=unk, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(lowercase=spec.lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(spec.tokens, spec.token_types) if kind == 3]
    )
    return backend


def _template_text(value, where: str) -> tuple[str | None, str | None]:
    """(the chat template's source, or None; why it is unusable, or None) of what a file holds: a
    string, or named templates ([{"name", "template"}], the "default" one taken)."""
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in value):
            return None, f"{where} must be a string or a list of {{name, template}}"
        value = next((t.get("template") for t in value if t["name"] == "default"), None)
        if value is None:
            return None, None  # no default: no chat template
        where = f"{where} 'default' template"
    if value is not None and not isinstance(value, str):
        return None, f"{where} must be a string, not {type(value).__name__}"
    return value, None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level vocabularies are spelled in)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


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
    source, where = raw.get("chat_template"), f"{path}: chat_template"
    jinja_file = model_dir / "chat_template.jinja"
    if source is None and jinja_file.is_file():
        source, where = jinja_file.read_text(), str(jinja_file)
    return special, source, where
