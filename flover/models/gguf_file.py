"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

One file holds everything a Hugging Face directory spreads over several: the architecture
(`{arch}.*` metadata) -> `ModelConfig`; the tensors, quantized or not -> `GGUFReader.read`, which
hands out Hugging Face-named float32 tensors so the models' weight specs work unchanged; and the
tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) -> `GGUFTokenizerSpec`, built into a
`tokenizers` tokenizer by flover.tokenizer.

Tensors are dequantized at load (`gguf.quants.dequantize`, vectorised NumPy). llama.cpp's
converter permutes the rows of Q and K of the Llama architecture for its RoPE kernel; that is
undone here. Under tensor parallelism each rank dequantizes a whole tensor, then keeps its slice
(quantized blocks run along a row, so rows could be sliced first; whole tensors keep Q/K's
un-permutation simple, and a rank holds one dequantized tensor at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flover.models.config import CheckpointError, ModelConfig

# general.architecture -> (our architecture, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K")

# Hugging Face name -> GGUF name (per layer: {i})
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


@dataclass
class GGUFTokenizerSpec:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    pre: str | None  # tokenizer.ggml.pre: which split regex the merges were learned with
    tokens: list[str]
    token_types: list[int]  # 1 normal, 3 control (special), 4 user-defined
    merges: list[str]
    scores: list[float] | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    chat_template: str | None


class GGUFFile:
    """The parsed file: metadata and tensor index (the data stays memory-mapped)."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: not found")
        try:
            self.parsed = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the gguf package raises ValueError/struct errors on damage
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.tensors = {t.name: t for t in self.parsed.tensors}
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: architecture {self.arch!r} is not supported; flover reads GGUF "
                                  f"files of {', '.join(ARCHITECTURES)}")

    def get(self, key: str, default=None):
        field = self.parsed.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata {key!r} is missing")
        return value

    # -- the model -------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        a = self.arch
        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"{self.path}: per-dimension RoPE frequencies (rope_freqs.weight, Llama 3.1 "
                                  f"scaling) are not supported yet")
        scaling = self.get(f"{a}.rope.scaling.type")
        if scaling not in (None, "none", "linear"):
            raise CheckpointError(f"{self.path}: RoPE scaling {scaling!r} is not supported (none, linear)")
        hidden, heads = self.require(f"{a}.embedding_length"), self.require(f"{a}.attention.head_count")
        head_dim = self.get(f"{a}.attention.key_length") or hidden // heads
        layers = self.require(f"{a}.block_count")
        window = self.get(f"{a}.attention.sliding_window")
        vocab = self.get(f"{a}.vocab_size") or len(self.parsed.fields["tokenizer.ggml.tokens"].data)
        eos = [self.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        qwen = a == "qwen2"
        return ModelConfig(
            architecture=ARCHITECTURES[a][0], hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=self.get(f"{a}.attention.head_count_kv") or heads, head_dim=head_dim,
            intermediate_size=self.require(f"{a}.feed_forward_length"), vocab_size=vocab,
            max_position_embeddings=self.get(f"{a}.context_length", 2048),
            norm_eps=float(self.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)), hidden_act="silu",
            tie_word_embeddings="output.weight" not in self.tensors,
            rope_theta=float(self.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=({"rope_type": "linear", "factor": float(self.require(f"{a}.rope.scaling.factor"))}
                          if scaling == "linear" else None),
            rotary_dim=head_dim, qkv_bias=qwen, o_bias=False, mlp_bias=False,
            sliding_windows=(window,) * layers if window else (None,) * layers,
            eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"), checkpoint_dtype=None)

    def reader(self, cfg: ModelConfig) -> "GGUFReader":
        return GGUFReader(self, cfg)

    # -- the tokenizer ---------------------------------------------------------------------
    def tokenizer_spec(self) -> GGUFTokenizerSpec | None:
        tokens = self.get("tokenizer.ggml.tokens")
        if tokens is None:
            return None
        model = self.get("tokenizer.ggml.model")
        return GGUFTokenizerSpec(
            model=model, pre=self.get("tokenizer.ggml.pre"), tokens=tokens,
            token_types=self.get("tokenizer.ggml.token_type") or [1] * len(tokens),
            merges=self.get("tokenizer.ggml.merges") or [], scores=self.get("tokenizer.ggml.scores"),
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"), eos_token_id=self.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(self.get("tokenizer.ggml.add_bos_token", model == "llama")),
            chat_template=self.get("tokenizer.chat_template"))


class GGUFReader:
    """The CheckpointReader interface over a GGUF file: Hugging Face tensor names in, float32
    tensors (dequantized, Q/K rows in Hugging Face order) out."""

    def __init__(self, gguf_file: GGUFFile, cfg: ModelConfig):
        self.file, self.dir = gguf_file, gguf_file.path
        self.names: dict[str, tuple[str, int | None]] = {}  # HF name -> (GGUF name, heads to un-permute)
        permuted = ARCHITECTURES[gguf_file.arch][1]
        for hf, name in _GLOBAL_NAMES.items():
            self.names[hf] = (name, None)
        for i in range(cfg.num_layers):
            for hf, name in _LAYER_NAMES.items():
                heads = None
                if permuted and hf == "self_attn.q_proj.weight":
                    heads = cfg.num_heads
                elif permuted and hf == "self_attn.k_proj.weight":
                    heads = cfg.num_kv_heads
                self.names[f"model.layers.{i}.{hf}"] = (f"blk.{i}.{name}", heads)

    def has(self, name: str) -> bool:
        return name in self.names and self.names[name][0] in self.file.tensors

    def read(self, source) -> torch.Tensor:
        import gguf

        if not self.has(source.name):
            raise CheckpointError(f"{self.dir}: tensor {source.name!r} ({self.names.get(source.name, ('?',))[0]}) "
                                  f"is missing from the file")
        name, heads = self.names[source.name]
        t = self.file.tensors[name]
        if t.tensor_type.name not in DEQUANTIZED_TYPES:
            raise CheckpointError(f"{self.dir}: tensor {name} has type {t.tensor_type.name}, which flover does not "
                                  f"read (it reads {', '.join(DEQUANTIZED_TYPES)})")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        if shape != tuple(source.shape):
            raise CheckpointError(f"{self.dir}: tensor {name} has shape {list(shape)}, expected {list(source.shape)}")
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        weight = torch.from_numpy(values if values.flags.writeable else values.copy())  # F32: a view of the map
        if heads is not None:
            weight = _unpermute_rows(weight, heads)
        if source.dim is None:
            return weight
        index = tuple(slice(source.start, source.stop) if d == source.dim else slice(None) for d in range(len(shape)))
        return weight[index]


def _unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's `permute`: per head, its rows were reordered from
    [first half, second half] (Hugging Face's rotate_half layout) to interleaved pairs."""
    rows = weight.shape[0]  # [heads * head_dim, cols]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
