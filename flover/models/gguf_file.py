"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

One file holds everything a Hugging Face directory spreads over several: the architecture
(`{arch}.*` metadata) -> `ModelConfig`; the tensors, quantized or not -> `GGUFReader.read`, which
hands out Hugging Face-named float32 tensors so the models' weight specs work unchanged; and the
tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) -> `GGUFTokenizerSpec`, built into a
`tokenizers` tokenizer by flover.models.tokenizer.

Tensors are dequantized at load (`gguf.quants.dequantize`, vectorised NumPy). llama.cpp's
converter permutes the rows of Q and K of the Llama architecture for its RoPE kernel; that is
undone here. Under tensor parallelism each rank dequantizes a whole tensor, then keeps its slice
(quantized blocks run along a row, so rows could be sliced first; whole tensors keep Q/K's
un-permutation simple, and a rank holds one dequantized tensor at a time).
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from flover.models.families import GGUF_ARCHES, gguf_family
from flover.models.families._shared import Family
from flover.models.gguf_grids import block_grid
from flover.models.model_config import CheckpointError, ModelConfig, MoEConfig, check_sizes, validate_model_config
from flover.models.pooling import GGUF_RANK, DenseConfig, Pooling, gguf_pooling

if TYPE_CHECKING:
    import torch

# an expert's projections -> the GGUF tensor that stacks them over the experts ([experts, out, in])
GGUF_EXPERT_NAMES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
DEQUANTIZED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "MXFP4",
    "Q2_K",
    "Q3_K",
    "IQ4_XS",
    "IQ4_NL",
)

# Hugging Face name -> GGUF name (per layer: {i})
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# norms the converter stores as they are where a family's others hold w + offset (Qwen3.5's gated one)
UNOFFSET_NORMS = ("ssm_norm.weight",)
MAX_ROW_SUM = 2.0**64  # |w| x row length above it: refused (GGUFWeights._check_magnitude)


def gguf_layer_names(family: Family) -> dict[str, str]:
    """Hugging Face name -> GGUF name of a layer's tensors, for a family's files."""
    return {**GGUF_LAYER_NAMES, **family.gguf_names}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


@dataclass
class GGUFTokenizerSpec:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (sentencepiece), "bert" (WordPiece)
    pre: str | None  # tokenizer.ggml.pre: which split regex the merges were learned with
    tokens: list[str]
    token_types: list[int]  # 1 normal, 3 control (special), 4 user-defined
    merges: list[str]
    scores: list[float] | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    chat_template: str | None
    add_eos: bool = False  # (BERT's: [CLS] text [SEP])
    lowercase: bool = False  # tokenizer.ggml.normalizer.lowercase (BERT's uncased WordPiece)
    unknown_token_id: int | None = None
    # SentencePiece's unigram model ("t5": XLM-RoBERTa's): its normalization, and its pair's
    # doubled separator (tokenizer.ggml.add_sep_token: `<s> a </s></s> b </s>`)
    add_space_prefix: bool = True
    remove_extra_whitespaces: bool = False
    precompiled_charsmap: bytes = b""
    add_sep: bool = False


class GGUFFile:
    """The parsed file: metadata and tensor index (the data stays memory-mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: not found")
        try:
            self.metadata, self.tensors, self._map = parse_gguf(self.path)
        except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError, struct.error) as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.arch = self.get("general.architecture")
        self.family = gguf_family(self) if isinstance(self.arch, str) else None
        if self.family is None:
            raise CheckpointError(
                f"{self.path}: architecture {self.arch!r} is not supported; flover reads GGUF "
                f"files of {', '.join(GGUF_ARCHES)}"
            )

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata {key!r} is missing")
        return value

    def integer(self, key: str, default=None, required: bool = False) -> int | None:
        """An integer field, or `default` when absent; anything else is refused naming the field."""
        value = self.require(key) if required else self.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointError(f"{self.path}: metadata {key!r} must be an integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.path}: metadata {key!r} must be a number, got {value!r}")
        return float(value)

    def default_max_tokens(self) -> int | None:
        return None  # (its context length is max_position_embeddings already)

    def pooling(self) -> Pooling | None:
        """How it makes embeddings, where llama.cpp's converter wrote an embedding model's pooling."""
        key = f"{self.arch}.pooling_type"
        kind = self.integer(key)
        if kind == GGUF_RANK or (kind is None and self.arch == "bert" and "cls.output.weight" in self.tensors):
            return self._rank_pooling(f"{self.path}: {key}")
        pooling = gguf_pooling(kind, f"{self.path}: {key}")
        if pooling is None:
            return None
        return dataclasses.replace(pooling, dense=self._dense_modules())

    def _rank_pooling(self, source: str) -> Pooling:
        """A reranker file (llama.cpp's rank pooling; a bert file with a classifier without it, as
        llama-server --rerank reads one): the first row (an encoder's) or the last (a decoder's)
        through the file's head as llama.cpp runs it: cls and tanh, then cls.output, whichever the
        file holds. Qwen3's two labels (yes, no) give the first one's softmax; one label sigmoid."""
        head = []
        for name, activation in (("cls", "tanh"), ("cls.output", "none")):
            t = self.tensors.get(f"{name}.weight")
            if t is None:
                continue
            if len(t.shape) != 2:
                raise CheckpointError(f"{self.path}: {name}.weight has shape {list(t.shape)}; a matrix expected")
            bias = f"{name}.bias" in self.tensors
            head.append(
                DenseConfig(self.path, t.shape[1], t.shape[0], bias, activation, f"{name}.weight", f"{name}.bias")
            )
        if not head:
            raise CheckpointError(f"{source}: a reranker's file without its head (cls / cls.output tensors)")
        causal, labels = self.get(f"{self.arch}.attention.causal", True), head[-1].out_features
        softmax = self.arch == "qwen3"  # (as llama.cpp: a Qwen3 reranker's yes / no)
        if softmax and labels != 2:
            raise CheckpointError(f"{self.path}: cls.output holds {labels} labels; a Qwen3 reranker's are yes, no")
        template = self.get("tokenizer.chat_template.rerank") if causal else None
        if causal and not (isinstance(template, str) and "{query}" in template and "{document}" in template):
            raise CheckpointError(
                f"{source}: a decoder reranker's file needs its rerank prompt (tokenizer.chat_template.rerank, "
                "text with {query} and {document})"
            )
        activation = "softmax" if softmax else "sigmoid" if labels == 1 else "none"
        mode = "last" if causal else "cls"
        return Pooling(
            mode,
            False,
            source,
            classify=True,
            activation=activation,
            dense=tuple(head),
            pair_template=template,
            scores_only=template is not None,
        )

    def _dense_modules(self) -> tuple[DenseConfig, ...]:
        """EmbeddingGemma's projections after the pooling, as the converter stores them (with
        --sentence-transformers-dense-modules): dense_2 then dense_3, without bias or activation."""
        found = []
        for name in ("dense_2.weight", "dense_3.weight"):
            t = self.tensors.get(name)
            if t is None:
                break
            if len(t.shape) != 2:
                raise CheckpointError(f"{self.path}: {name} has shape {list(t.shape)}; a matrix expected")
            out_features, in_features = t.shape
            found.append(DenseConfig(self.path, in_features, out_features, False, "none", weight_name=name))
        return tuple(found)

    def check_tensors(self, cfg: ModelConfig) -> None:
        """The header's shape against the tensors the file holds, before anything is built from it."""
        layers = {int(m.group(1)) for name in self.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
        if layers != set(range(cfg.num_layers)):
            raise CheckpointError(
                f"{self.path}: {self.arch}.block_count is {cfg.num_layers}, but the file holds "
                f"tensors of {len(layers)} layer(s)"
            )
        embed = self.tensors.get("token_embd.weight")
        if embed is None or embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise CheckpointError(
                f"{self.path}: token_embd.weight has shape {list(embed.shape) if embed else None}, "
                f"the metadata says [{cfg.vocab_size}, {cfg.hidden_size}]"
            )

    # -- the model -------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        """The fields every GGUF file names alike ({arch}.*), a mixture of experts where the file
        has one, then what its family reads beyond them (families/<name>.py's from_gguf)."""
        a, family = self.arch, self.family
        scaling = self.get(f"{a}.rope.scaling.type")
        if scaling is not None and scaling not in family.gguf_rope_types:
            raise CheckpointError(
                f"{self.path}: RoPE scaling {scaling!r} is not supported ({', '.join(family.gguf_rope_types)})"
            )
        where = str(self.path)
        hidden = self.integer(f"{a}.embedding_length", required=True)
        heads = self.integer(f"{a}.attention.head_count", required=True)
        sizes = {
            "embedding_length": hidden,
            "attention.head_count": heads,
            "block_count": self.integer(f"{a}.block_count", required=True),
            "feed_forward_length": self._dense_width(),
            "context_length": self.integer(f"{a}.context_length", 2048),
            "attention.head_count_kv": self.first_integer(f"{a}.attention.head_count_kv"),
            "attention.key_length": self.integer(f"{a}.attention.key_length"),
            "attention.sliding_window": self.integer(f"{a}.attention.sliding_window"),
            "vocab_size": self.integer(f"{a}.vocab_size") or len(self.get("tokenizer.ggml.tokens") or ()),
        }
        check_sizes({f"{a}.{k}": v for k, v in sizes.items()}, where, optional=True)  # present ones
        head_dim = sizes["attention.key_length"] or hidden // heads
        layers, window = sizes["block_count"], sizes["attention.sliding_window"]
        eos = [self.integer(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        cfg = ModelConfig(
            architecture=family.hf_architectures[0],
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=sizes["attention.head_count_kv"] or heads,
            head_dim=head_dim,
            intermediate_size=sizes["feed_forward_length"],
            vocab_size=sizes["vocab_size"],
            max_position_embeddings=sizes["context_length"],
            norm_eps=self.number(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            hidden_act="silu",
            tie_word_embeddings="output.weight" not in self.tensors,
            rope_theta=self.number(f"{a}.rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(scaling, head_dim),
            rotary_dim=head_dim,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            sliding_windows=(window,) * layers if window else (None,) * layers,
            eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
            bos_token_id=self.integer("tokenizer.ggml.bos_token_id"),
            checkpoint_dtype=None,
        )
        if self.has_experts():
            cfg = self._experts(cfg)  # (an expert_count of 0 is refused there, naming the field)
        if family.from_gguf is not None:
            cfg = family.from_gguf(self, cfg)
        validate_model_config(cfg, where)
        return cfg

    def _dense_width(self) -> int:
        """feed_forward_length; a file with experts in every layer may lack it (Qwen3.5-MoE's):
        then the experts' width stands in (no layer reads it)."""
        a = self.arch
        if self.get(f"{a}.feed_forward_length") is None and self.has_experts():
            return self.integer(f"{a}.expert_feed_forward_length", required=True)
        return self.first_integer(f"{a}.feed_forward_length", required=True)

    def first_integer(self, key: str, default=None, required: bool = False) -> int | None:
        """An integer field, or the first layer's of a per-layer array (Gemma 4's widths and kv
        heads: its family file reads the others)."""
        value = self.require(key) if required else self.get(key, default)
        if isinstance(value, list) and value:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise CheckpointError(f"{self.path}: metadata {key!r} must hold integers")
            return value[0]
        return self.integer(key, default, required)

    def has_experts(self) -> bool:
        """An expert count in the metadata, or a layer with a router (ffn_gate_inp)."""
        return self.get(f"{self.arch}.expert_count") is not None or any(
            name.endswith(".ffn_gate_inp.weight") for name in self.tensors
        )

    def _experts(self, cfg: ModelConfig) -> ModelConfig:
        """A mixture of experts, read as llama.cpp reads it: expert_count, expert_used_count, each
        expert's width (expert_feed_forward_length, else feed_forward_length), the top k always
        renormalised; experts in the layers that hold a router (ffn_gate_inp), stacked in
        ffn_{gate,up,down}_exps."""
        a = self.arch
        sizes = {
            f"{a}.expert_count": self.integer(f"{a}.expert_count", required=True),
            f"{a}.expert_used_count": self.integer(f"{a}.expert_used_count", required=True),
            f"{a}.expert_feed_forward_length": self.integer(f"{a}.expert_feed_forward_length") or cfg.intermediate_size,
        }
        check_sizes(sizes, str(self.path))
        experts, top_k, inter = sizes.values()
        if self.number(f"{a}.expert_weights_scale", 1.0) != 1.0:
            raise CheckpointError(f"{self.path}: {a}.expert_weights_scale other than 1 is not supported")
        layers = frozenset(i for i in range(cfg.num_layers) if f"blk.{i}.ffn_gate_inp.weight" in self.tensors)
        moe = MoEConfig(experts=experts, top_k=top_k, intermediate=inter, norm_topk_prob=True, layers=layers)
        return dataclasses.replace(cfg, moe=moe)

    def _rope_scaling(self, scaling: str | None, head_dim: int) -> dict | None:
        """Linear scaling, or Llama 3's per-dimension divisors of the frequencies (rope_freqs.weight,
        [head_dim / 2] float32: llama.cpp's converter writes them in place of the llama3 settings)."""
        if "rope_freqs.weight" in self.tensors:
            return {"rope_type": "freq_factors", "factors": self.rope_factors("rope_freqs.weight", head_dim // 2)}
        if scaling == "linear":
            return {"rope_type": "linear", "factor": self.number(f"{self.arch}.rope.scaling.factor", None)}
        return None

    def rope_factors(self, name: str, count: int) -> tuple[float, ...]:
        """A tensor of per-dimension RoPE factors: F32 [count], each positive and finite."""
        t = self.tensors[name]
        if t.type_name != "F32" or t.shape != (count,):
            raise CheckpointError(f"{self.path}: {name} is {t.type_name} {list(t.shape)}, expected F32 [{count}]")
        factors = t.data.view(np.float32)
        if not np.isfinite(factors).all() or (factors <= 0).any():
            raise CheckpointError(f"{self.path}: {name} holds a factor that is not positive and finite")
        return tuple(float(f) for f in factors)

    def drop_resident_pages(self) -> None:
        """Once the weights are copied out: the pages of the file read so far leave this process
        (they stay in the page cache; a later read faults them back in). Counted as resident
        otherwise: the whole file beside the copies (1.1 GB for a 1B Q8_0 file)."""
        import mmap

        mapping = getattr(self._map, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def head_is_quantized(self) -> bool:
        """Whether the LM head (or the tied token embedding) is stored in blocks of codes: then it
        stays 16-bit here rather than being quantized a second time."""
        head = self.tensors.get("output.weight") or self.tensors.get("token_embd.weight")
        return head is not None and head.type_name not in ("F32", "F16", "BF16")

    def projection_types(self) -> set[str]:
        """The block types of the layers' projection weights (e.g. {"Q4_1"})."""
        names = [name for hf, name in GGUF_LAYER_NAMES.items() if hf.endswith("proj.weight")] + list(GGUF_EXPERT_NAMES)
        return {t.type_name for n, t in self.tensors.items() if n.startswith("blk.") and n.split(".", 2)[2] in names}

    def reader(self, cfg: ModelConfig) -> "GGUFReader":
        return GGUFReader(self, cfg)

    # -- the tokenizer ---------------------------------------------------------------------
    def tokenizer_spec(self) -> GGUFTokenizerSpec | None:
        tokens = self.get("tokenizer.ggml.tokens")
        if tokens is None:
            return None
        model = self.get("tokenizer.ggml.model")
        return GGUFTokenizerSpec(
            model=model,
            pre=self.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=self.get("tokenizer.ggml.token_type") or [1] * len(tokens),
            merges=self.get("tokenizer.ggml.merges") or [],
            scores=self.get("tokenizer.ggml.scores"),
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(self.get("tokenizer.ggml.add_bos_token", model == "llama")),
            chat_template=self.get("tokenizer.chat_template"),
            add_eos=bool(self.get("tokenizer.ggml.add_eos_token", False)),
            lowercase=bool(self.get("tokenizer.ggml.normalizer.lowercase", False)),
            unknown_token_id=self.get("tokenizer.ggml.unknown_token_id"),
            add_space_prefix=bool(self.get("tokenizer.ggml.add_space_prefix", True)),
            remove_extra_whitespaces=bool(self.get("tokenizer.ggml.remove_extra_whitespaces", False)),
            precompiled_charsmap=self._bytes("tokenizer.ggml.precompiled_charsmap"),
            add_sep=bool(self.get("tokenizer.ggml.add_sep_token", False)),
        )

    def _bytes(self, key: str) -> bytes:
        """An array of bytes (b"" where absent)."""
        value = self.get(key) or b""
        try:
            if isinstance(value, (list, bytes)):
                return bytes(value)
        except (TypeError, ValueError):
            pass
        raise CheckpointError(f"{self.path}: metadata {key!r} must be an array of bytes")


class GGUFReader:
    """The CheckpointReader interface over a GGUF file: Hugging Face tensor names in, float32
    tensors (dequantized, Q/K rows in Hugging Face order) out."""

    def __init__(self, gguf_file: GGUFFile, cfg: ModelConfig):
        self.file, self.dir = gguf_file, gguf_file.path
        # HF name -> (GGUF name, heads to un-permute); an expert's: its index in the stacked tensor
        self.names: dict[str, tuple[str, int | None]] = {}
        self.experts: dict[str, int] = {}
        self.halves: dict[str, int] = {}  # an expert's gate (0) or up (1): rows of a fused gate_up tensor
        self._grids: dict[str, object] = {}
        self.norm_offset = cfg.norm_offset  # (the converter stored w + offset: llama.cpp's norms add nothing)
        family = gguf_file.family
        permuted = family.gguf_qk_permuted
        for hf, name in {**GGUF_GLOBAL_NAMES, **family.gguf_global_names}.items():
            self.names[hf] = (name, None)
        for i in range(cfg.num_layers):
            for hf, name in gguf_layer_names(family).items():
                heads = None
                if permuted and hf == "self_attn.q_proj.weight":
                    heads = cfg.num_heads
                elif permuted and hf == "self_attn.k_proj.weight":
                    heads = cfg.num_kv_heads
                self.names[f"{family.layer_prefix}.{i}.{hf}"] = (f"blk.{i}.{name}", heads)
            if cfg.moe is not None and i in cfg.moe.layers:
                self._expert_names(cfg.moe, i)

    def _expert_names(self, moe, i: int) -> None:
        """Layer i's router and each expert's gate, up and down: parts of the stacked tensors
        (gate and up: the halves of ffn_gate_up_exps where the file fuses them, as Gemma 4's)."""
        block = moe.block_of(f"model.layers.{i}")
        fused = f"blk.{i}.ffn_gate_up_exps.weight" in self.file.tensors
        for kind in ("weight", "bias"):  # (biases: gpt-oss's router and experts)
            self.names[f"{block}.{moe.router}.{kind}"] = (f"blk.{i}.ffn_gate_inp.{kind}", None)
            for e in range(moe.experts):
                for half, (hf, name) in enumerate(zip(moe.projections, GGUF_EXPERT_NAMES)):
                    stacked = name.replace(".weight", f".{kind}")
                    key = f"{block}.experts.{e}.{hf}.{kind}"
                    if fused and half < 2:
                        stacked = f"ffn_gate_up_exps.{kind}"
                        self.halves[key] = half
                    self.names[key] = (f"blk.{i}.{stacked}", None)
                    self.experts[key] = e

    def row_table(self, source) -> "RowTable | None":
        """A table read a row at a time from the file's codes (Gemma 4's per-layer embeddings:
        GBs dequantized, a few rows an iteration used): `source`'s columns of the rows asked for."""
        name, _ = self.names[source.name]
        t = self.file.tensors.get(name)
        if t is None or t.type_name not in DEQUANTIZED_TYPES or t.shape != tuple(source.shape) or len(t.shape) != 2:
            return None
        return RowTable(t, source.start if source.dim == 1 else 0, source.stop if source.dim == 1 else t.shape[1])

    def has(self, name: str) -> bool:
        return name in self.names and self.names[name][0] in self.file.tensors

    def read(self, source) -> torch.Tensor:
        if not self.has(source.name):
            raise CheckpointError(
                f"{self.dir}: tensor {source.name!r} ({self.names.get(source.name, ('?',))[0]}) "
                f"is missing from the file"
            )
        name, heads = self.names[source.name]
        t = self._tensor(source.name)
        if t.type_name not in DEQUANTIZED_TYPES:
            raise CheckpointError(
                f"{self.dir}: tensor {name} has type {t.type_name}, which flover does not "
                f"read (it reads {', '.join(DEQUANTIZED_TYPES)})"
            )
        if t.shape not in (
            tuple(source.shape),
            tuple(d for d in source.shape if d != 1),
        ):  # (a conv's [C, 1, K] squeezed)
            raise CheckpointError(f"{self.dir}: tensor {name} has shape {list(t.shape)}, expected {list(source.shape)}")
        import torch  # (this module is read without torch by the HTTP front)

        # (a NaN block scale: every greedy answer token 0; a grid's values are finite where its scales are)
        found = self._block_grid(source.name, t)
        if found is not None:
            weight = found.values_tensor()
            finite = all(np.isfinite(a).all() for a in (found.scale, found.low) if a is not None)
        else:
            weight = torch.from_numpy(t.dequantize())
            finite = bool(torch.isfinite(weight).all())
        if not finite:
            raise CheckpointError(f"{self.dir}: tensor {name} holds values that are not finite (NaN or infinity)")
        if found is None and weight.numel():
            low, high = torch.aminmax(weight)
            self._check_magnitude(name, max(-float(low), float(high)), t.shape[-1])
        if heads is not None:
            weight = _unpermute_rows(weight, heads)
        if self.norm_offset and name.endswith("norm.weight") and not name.endswith(UNOFFSET_NORMS):
            weight = weight - self.norm_offset
        weight = weight.reshape(source.shape)
        if source.dim is None:
            return weight
        index = tuple(
            slice(source.start, source.stop) if d == source.dim else slice(None) for d in range(len(source.shape))
        )
        return weight[index]

    def read_grid(self, source):
        """A quantized tensor's own grid (models/quant.Grid: codes, scales, minimums as its blocks
        hold them, models/gguf_grids.py), rows un-permuted and sliced as read() does; None for
        types without one (F16, ...) and for slices that cut a group."""
        import torch

        from flover.models.quant import Grid

        name, heads = self.names[source.name]
        t = self._tensor(source.name)
        if t.shape != tuple(source.shape):
            return None
        found = self._block_grid(source.name, t)
        if found is None:
            return None
        parts = [torch.from_numpy(a) for a in (found.codes, found.scale, found.low) if a is not None]
        supers = [torch.from_numpy(a) for a in found.supers] if found.supers is not None else None
        if not all(torch.isfinite(a).all() for a in [*parts[1:], *(supers or ())] if a.is_floating_point()):
            raise CheckpointError(f"{self.dir}: tensor {name} holds block scales that are not finite (NaN or infinity)")
        if heads is not None:
            parts = [_unpermute_rows(a, heads) for a in parts]
            supers = supers and [_unpermute_rows(a, heads) for a in supers]
        group = found.group
        if source.dim == 0:
            parts = [a[source.start : source.stop] for a in parts]
            supers = supers and [a[source.start : source.stop] for a in supers]
        elif source.dim == 1:
            if source.start % group or source.stop % group:
                return None
            parts = [parts[0][:, source.start : source.stop]] + [
                a[:, source.start // group : source.stop // group] for a in parts[1:]
            ]
            if supers and (source.start % 256 or source.stop % 256):
                supers = None  # a cut through a super-block: the stored scales serve
            elif supers:
                per = [t.shape[1] // a.shape[1] for a in supers]  # inputs per column: 256, or the group
                supers = [a[:, source.start // n : source.stop // n] for a, n in zip(supers, per)]
        parts = [a.contiguous() for a in parts]
        supers = tuple(a.contiguous() for a in supers) if supers else None
        return Grid(
            parts[0], parts[1], parts[2] if found.low is not None else None, group, found.bits, found.code_range, supers
        )

    def _block_grid(self, hf_name: str, t: "GGUFTensor"):
        """The tensor's grid (gguf_grids.BlockGrid; None for other types), kept for the next calls:
        load_weights reads a projection's sources' values, then their grids. (Its values are what the `gguf`
        package dequantizes, bit for bit, at a tenth of the time.)"""
        if hf_name not in self._grids:
            if len(self._grids) >= 4:  # (a fused projection's sources: up to 3)
                self._grids.clear()
            found = block_grid(t.type_name, t.data, t.shape)
            if (
                found is not None
                and np.isfinite(found.scale).all()
                and (found.low is None or np.isfinite(found.low).all())
            ):
                low, high = found.code_range
                largest = float(np.abs(found.scale).max(initial=0)) * max(-low, high)
                largest += 0.0 if found.low is None else float(np.abs(found.low).max(initial=0))
                self._check_magnitude(self.names[hf_name][0], largest, t.shape[-1])
            self._grids[hf_name] = found
        return self._grids[hf_name]

    def _check_magnitude(self, name: str, largest: float, row: int) -> None:
        """A weight so large that one row's sum leaves float32's range (e.g. MXFP4 scale byte 254, 2^126)
        is finite but turns every logit into NaN or infinity: refused. The bound, |w| x row length
        <= 2^64, leaves float32 (2^128) room for activations up to 2^64."""
        if largest * max(1, row) > MAX_ROW_SUM:
            raise CheckpointError(
                f"{self.dir}: tensor {name} holds a value of magnitude {largest:.3g}: with rows of {row} inputs "
                f"its sums leave float32's range (flover refuses weights whose |w| x row length passes 2^64)"
            )

    def _tensor(self, hf_name: str) -> "GGUFTensor":
        """The GGUF tensor behind a Hugging Face name: an expert's is its part of the stacked one."""
        t = self.file.tensors[self.names[hf_name][0]]
        expert = self.experts.get(hf_name)
        if expert is None:
            return t
        if len(t.shape) not in (2, 3) or expert >= t.shape[0]:
            raise CheckpointError(
                f"{self.dir}: tensor {t.name} has shape {list(t.shape)}, expected [experts, out, in] or [experts, out]"
            )
        size = t.data.size // t.shape[0]  # (whole blocks: parse_gguf checked each row is)
        data, shape = t.data[expert * size : (expert + 1) * size], t.shape[1:]
        half = self.halves.get(hf_name)
        if half is not None:  # (the first or the second half of the expert's rows)
            if shape[0] % 2:
                raise CheckpointError(f"{self.dir}: tensor {t.name} has an odd row count {shape[0]}")
            size //= 2
            data, shape = data[half * size : (half + 1) * size], (shape[0] // 2, *shape[1:])
        return GGUFTensor(t.name, shape, t.qtype, data)


@dataclass
class RowTable:
    """Rows of a GGUF tensor dequantized on demand: columns [start, stop) of each."""

    tensor: "GGUFTensor"
    start: int
    stop: int

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """ids [n] -> float32 [n, stop - start] (ids must lie within the table: the caller's check)."""
        t = self.tensor
        raw = t.data.reshape(t.shape[0], -1)[ids]  # [n, a row's bytes]: whole blocks each
        values = GGUFTensor(t.name, (len(ids), t.shape[1]), t.qtype, raw.reshape(-1)).dequantize()
        return values[:, self.start : self.stop]

    def finite(self, chunk: int = 4096) -> bool:
        """Whether every value is finite (checked once at load, a chunk of rows at a time)."""
        return all(
            np.isfinite(self.rows(np.arange(at, min(at + chunk, self.tensor.shape[0])))).all()
            for at in range(0, self.tensor.shape[0], chunk)
        )


def _unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's `permute`: per head, its rows were reordered from
    [first half, second half] (Hugging Face's rotate_half layout) to interleaved pairs."""
    rows = weight.shape[0]  # [heads * head_dim, cols]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# -- the file format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) ----------------
# The gguf package's reader builds a NumPy view per field part; for a 49k-token vocabulary and
# 49k merges that takes seconds, so the header is parsed here in one pass over the bytes.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # Hugging Face order (outermost first)
    qtype: int  # ggml type id
    data: np.ndarray  # the raw bytes (a view of the memory map)

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"ggml type {self.qtype}"

    def dequantize(self) -> np.ndarray:
        """float32 values in `shape` (a fresh array)."""
        import gguf

        name = self.type_name
        if name == "F32":
            return self.data.view(np.float32).reshape(self.shape).copy()
        if name == "F16":
            return self.data.view(np.float16).astype(np.float32).reshape(self.shape)
        if name == "BF16":
            return (self.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        if name in _FAST:
            return _FAST[name](self.data).reshape(self.shape)
        rows = self.data.reshape(-1, self.data.size // max(1, int(np.prod(self.shape[:-1]))))
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(self.qtype))
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


# The common block types in one vectorised pass over all blocks (the gguf package walks row groups,
# slower); the same float32 arithmetic, so the same values bit for bit (tested).
def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [blocks, 32]: low halves first


def _q8_0(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(-1, 34)
    return _scale(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(-1, 18)
    return _scale(blocks, 0) * (_nibbles(blocks[:, 2:]) - np.float32(8))


def _q4_1(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(-1, 20)
    return _scale(blocks, 0) * _nibbles(blocks[:, 4:]) + _scale(blocks, 2)


_FAST = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


def parse_gguf(path: Path) -> tuple[dict, dict[str, GGUFTensor], np.memmap]:
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (flover reads 2 and 3)")
    cursor = _Cursor(buf, 24)
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = cursor.unpack("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, cursor.pos)
        cursor.pos += 8 * n_dims
        qtype, offset = struct.unpack_from("<IQ", buf, cursor.pos)
        cursor.pos += 12
        infos.append((name, dims, qtype, offset))
    alignment = metadata.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
        raise ValueError(f"general.alignment {alignment!r} is not a positive multiple of 8")
    start = (cursor.pos + alignment - 1) // alignment * alignment
    return metadata, _place_tensors(raw, infos, start, alignment), raw


class _Cursor:
    """Reads the header's values one after another (strings, arrays, scalars) from `pos` on."""

    def __init__(self, buf: memoryview, pos: int):
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str):
        (item,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return item

    def string(self) -> str:
        n = self.unpack("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.unpack(_SCALARS[kind])
        inner, count = struct.unpack_from("<IQ", self.buf, self.pos)
        self.pos += 12
        if inner in (_STRING, _ARRAY):
            return [self.value(inner) for _ in range(count)]
        fmt = _SCALARS[inner]
        items = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos).tolist()
        self.pos += struct.calcsize(fmt) * count
        return items


def _place_tensors(raw: np.memmap, infos: list, start: int, alignment: int) -> dict[str, GGUFTensor]:
    """Each tensor's bytes in the file: whole blocks, aligned, inside the file, none listed twice
    and none overlapping another."""
    import gguf

    sizes = {t.value: block_and_bytes for t, block_and_bytes in gguf.GGML_QUANT_SIZES.items()}
    tensors, spans = {}, []
    for name, dims, qtype, offset in infos:
        block, size = sizes.get(qtype, (1, 0))  # an unknown type reads as empty; read() names it
        count = math.prod(dims)
        if count % block or (dims and dims[0] % block):
            raise ValueError(
                f"tensor {name}: its rows of {dims[0] if dims else 0} values are not whole blocks of {block}"
            )
        nbytes = count // block * size
        if offset % alignment:  # (the spec aligns every tensor's data; a shifted one reads garbage)
            raise ValueError(f"tensor {name}: offset {offset} is not a multiple of general.alignment {alignment}")
        begin = start + offset
        if begin + nbytes > raw.size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        if name in tensors:
            raise ValueError(f"tensor {name} is listed twice")
        spans.append((begin, begin + nbytes, name))
        tensors[name] = GGUFTensor(name, tuple(int(d) for d in reversed(dims)), qtype, raw[begin : begin + nbytes])
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:  # another tensor's bytes read as this one's: garbage, not an error, at run time
            raise ValueError(f"tensors {first} and {second} overlap")
    return tensors
