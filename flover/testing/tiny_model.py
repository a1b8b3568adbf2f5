"""Random checkpoints for tests, demos and benchmarks, made offline and deterministically:
transformers writes the model (fixed seed), `tokenizers` trains a byte-level BPE on a corpus that
is generated here from a fixed seed. The weights are random, so generated text is meaningless.

Needs the `tools` extra (transformers).
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

from flover.models.families import BY_ARCHITECTURE, FAMILIES
from flover.models.families._shared import decoder_test_kwargs

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"  # flover/presets/*.json
ARCHS = tuple(name for name, family in FAMILIES.items() if family.test_config)  # what make_tiny_model makes
EOS = "<|endoftext|>"
# ChatML, so that `messages` prompts can be exercised on random models too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an of to in and or but if then when while fuse batch request token model layer "
    "memory slot buffer kernel iteration arrive finish return stream engine rank shard "
    "time fast slow small large first last new old one two three four five six seven eight "
    "nine ten is was be are were has have had do does did not no yes can will would should "
    "cat dog bird fish tree river mountain city road house light dark red blue green yellow "
    "run walk read write think speak see hear find give take make know want need use work "
    "über café naïve 東京 数据 模型 ✓ → λ π ∑"
).split()


def corpus(num_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        words = rng.choices(_WORDS, k=rng.randint(4, 16))
        number = str(rng.randint(0, 10 ** rng.randint(1, 6)))
        lines.append(" ".join(words).capitalize() + f" {number}{rng.choice('.,!?;:')}")
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE padded with plain added tokens up to `vocab_size`, so that every id the
    model can produce decodes to some text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([AddedToken(f"<w{i}>", special=False) for i in range(missing)])
    return tok


def train_spm_style_tokenizer(vocab_size: int, seed: int = 0):
    """A BPE over raw UTF-8 with spaces spelled U+2581 and byte fallback (<0xNN> tokens), as
    Gemma's tokenizer.json: the kind llama.cpp's converter writes as tokenizer model "gemma4"."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    spec = json.loads(tok.to_str())  # (the byte tokens: vocabulary entries, not added tokens, as Gemma's)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return Tokenizer.from_str(json.dumps(spec))


def load_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not path.is_file():
        path = PRESETS_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(PRESETS_DIR.glob("*.json")))
        raise ValueError(f"unknown preset {name_or_path!r}; known: {known}")
    return json.loads(path.read_text())


def hf_config(arch: str, preset: dict, eos_id: int, **overrides):
    """The transformers config object for family `arch` (families/<arch>.py) with the preset's sizes."""
    import transformers

    family = FAMILIES[arch]
    common = dict(
        vocab_size=preset["vocab_size"],
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=preset.get("tie_word_embeddings", False),
    )
    kwargs = (family.test_kwargs or decoder_test_kwargs)(preset, eos_id)
    return getattr(transformers, family.test_config)(**{**common, **kwargs, **overrides})


def make_tiny_model(arch: str, preset: str | dict, out: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a checkpoint directory (config, safetensors, tokenizer) and return its path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError("making a model needs transformers: pip install 'flover[tools]'") from e
    preset = load_preset(preset) if isinstance(preset, str) else preset
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(preset["vocab_size"], seed)
    eos_id = tok.token_to_id(EOS)
    config = hf_config(arch, preset, eos_id, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    slow_decays(model)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.bos_token_id = eos_id
    model.save_pretrained(out)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def slow_decays(model) -> None:
    """Recurrent layers (Gated DeltaNet): every other head forgets slowly (a decay of ~0.9995 a
    token, as trained models have heads that keep context), so that a state a test gets wrong
    shows in the tokens long after (random init forgets within a few tokens)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param[::2] = torch.log(torch.tensor(0.05))
            elif name.endswith("linear_attn.dt_bias"):
                param[::2] = -4.0


# K-quants the `gguf` package cannot make: random blocks, with this super-block scale (d, dmin)
# so that the weights stay small
RANDOM_BLOCK_SCALES = {
    "Q4_K": 0.0004,
    "Q5_K": 0.0002,
    "Q6_K": 0.0001,
    "Q2_K": 0.0004,
    "Q3_K": 0.0002,
    "IQ4_XS": 0.00001,  # (times a 6-bit scale times a table value up to 127)
    "IQ4_NL": 0.0004,
}
# 2-D tensors the converter and llama-quantize keep in F32 (routers, Qwen3.5's conv taps)
F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", ".bias")
# where each type's float16 block scales sit in a block (ggml-common.h's block layouts): byte offsets
BLOCK_SCALE_OFFSETS = {"Q6_K": (-2,), "Q2_K": (-4, -2), "Q3_K": (-2,), "IQ4_XS": (0,), "IQ4_NL": (0,)}


def write_gguf(
    model_dir: str | Path,
    out: str | Path,
    qtype: str = "Q8_0",
    types: dict[str, str] | None = None,
    seed: int = 0,
    arch: str | None = None,
    extra=None,
    skip: tuple[str, ...] = (),
) -> Path:
    """Write a Hugging Face directory (of a family flover reads GGUF files of) as one GGUF file the
    way llama.cpp's convert_hf_to_gguf.py lays it out (metadata names, Q/K row permutation where
    the converter permutes, 1-D tensors kept in F32), with 2-D tensors stored as `qtype` (F32,
    F16, BF16, Q8_0, Q4_0, Q4_1, ... whatever the `gguf` package's quantizer implements). `types`:
    GGUF name ending -> type, for mixes such as Q4_K_M's (attn_v.weight: Q6_K); K-quants
    (RANDOM_BLOCK_SCALES) hold random blocks, not the checkpoint's values. For tests: real GGUF
    files of random models, in the types users download. `arch`: general.architecture where the
    converter names this family's file otherwise (gemma-embedding); `extra(writer)` adds what
    else the file holds (an embedding model's pooling and Dense tensors); `skip`: Hugging Face
    tensor names it leaves out (a reranker's LM head, which the converter drops)."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    family = BY_ARCHITECTURE.get((config.get("architectures") or [""])[0])
    gguf_family = family if family is None or family.gguf_arch else FAMILIES["llama"]  # (as llama.cpp: Mistral)
    if gguf_family is None or gguf_family.gguf_arch is None:
        raise ValueError(f"{model_dir}: its family's GGUF files are not read by flover")
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if not any(name.startswith("model.") for name in tensors):  # (a base model's: Gemma3TextModel's)
        tensors = {f"model.{name}": t for name, t in tensors.items()}
    tensors = {name: t for name, t in tensors.items() if name not in skip}
    w = gguf.GGUFWriter(str(out), arch or gguf_family.gguf_arch)
    w.add_name(model_dir.name)
    rope = _write_gguf_metadata(w, config, gguf_family.gguf_arch)
    _write_gguf_tokenizer(w, model_dir)
    for key, value in (family.test_gguf_metadata(config) if family.test_gguf_metadata else {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    if family.test_gguf_tensors is not None:
        tensors = family.test_gguf_tensors(config, tensors)
    tensors = _write_family_metadata(w, config, gguf_family.gguf_arch, rope, tensors)
    _write_gguf_tensors(w, config, gguf_family, tensors, qtype, types or {}, seed)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _write_gguf_metadata(w, config: dict, arch: str) -> dict:
    """The keys every file names alike, as the converter writes them; the RoPE settings back."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    rope_parameters = config.get("rope_parameters") or {}
    if arch == "gemma3":  # (per layer type: the global layers' in the usual keys, the local base apart)
        rope_parameters = rope_parameters.get("full_attention") or {}
    theta = rope_parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    if "intermediate_size" in config:  # (as the converter: not for experts-only models such as Qwen3.5-MoE)
        w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim != config["hidden_size"] // heads:  # as the converter: only a head_dim of its own
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = {**(config.get("rope_scaling") or {}), **rope_parameters, "rope_theta": theta}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(
        int(partial * config["hidden_size"]) // heads if arch == "phi3" else int(partial * head_dim)
    )
    return rope


def _write_family_metadata(w, config: dict, arch: str, rope: dict, tensors: dict) -> dict:
    """What the converter writes for these families beyond the common keys (its per-architecture
    classes); the tensors back, experts stacked as it stacks them."""
    import gguf

    if arch == "phi3":
        _write_phi3_rope(w, config, rope)
    if arch == "gemma3":  # as the converter writes it (the pattern stays llama.cpp's default: every 6th global)
        local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
        w.add_float32(f"{w.arch}.rope.freq_base_swa", float(local.get("rope_theta", 10000.0)))
        w.add_sliding_window(config["sliding_window"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:  # as the converter: the experts' counts and width; their tensors stacked below
        w.add_expert_count(experts)
        w.add_expert_used_count(config.get("num_experts_per_tok") or config["top_k_experts"])
        if arch in ("qwen3moe", "gpt-oss", "qwen35moe"):
            w.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
        tensors = _gpt_oss_experts(tensors) if arch == "gpt-oss" else _stack_experts(tensors)
    if arch == "gpt-oss":  # its window, every other layer from the first (llama.cpp's pattern of 2)
        w.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") == "yarn":  # (as the converter: its type, factor and original length)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if rope.get("rope_type") == "llama3":  # as convert_hf_to_gguf.py: per-dimension divisors
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, float(rope["rope_theta"]), head_dim))
    return tensors


def _write_gguf_tensors(w, config: dict, family, tensors: dict, qtype: str, types: dict, seed: int) -> None:
    """Every tensor under its GGUF name, Q/K permuted where the converter permutes, in its type."""
    import gguf
    import numpy as np

    from flover.models.gguf_file import GGUF_GLOBAL_NAMES, UNOFFSET_NORMS, gguf_layer_names

    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    rng = np.random.default_rng(seed)
    permute = lambda x, n: x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)  # noqa
    names = {**GGUF_GLOBAL_NAMES, **family.gguf_global_names}
    for i in range(config["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in gguf_layer_names(family).items()})
        for block in ("mlp", "block_sparse_moe"):  # (Qwen3-MoE's, Mixtral's router)
            names[f"model.layers.{i}.{block}.gate.weight"] = f"blk.{i}.ffn_gate_inp.weight"
        for kind in ("weight", "bias"):  # (gpt-oss's)
            names[f"model.layers.{i}.mlp.router.{kind}"] = f"blk.{i}.ffn_gate_inp.{kind}"
    offset = float(family.from_hf(config).get("norm_offset", 0.0))  # (Gemma's: the converter stores 1 + w)
    for hf_name, data in tensors.items():
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        name = names.get(hf_name, hf_name)  # (stacked experts: already their GGUF name)
        data = data.astype(np.float32)
        if offset and name.endswith("norm.weight") and not name.endswith(UNOFFSET_NORMS):
            data = data + offset
        if family.gguf_qk_permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = permute(data, heads if name.endswith("attn_q.weight") else kv_heads)
        kind = next((t for end, t in types.items() if name.endswith(end)), qtype)
        qt = gguf.GGMLQuantizationType[kind]
        if data.ndim == 1 or qt == gguf.GGMLQuantizationType.F32 or name.endswith(F32_TENSORS):
            w.add_tensor(name, data)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif kind in RANDOM_BLOCK_SCALES:
            w.add_tensor(name, _random_k_blocks(rng, data.shape, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)


def _stack_experts(tensors: dict) -> dict:
    """Each layer's per-expert tensors ({block}.experts.{e}.{projection}) -> one stacked tensor
    [experts, out, in] per projection under its GGUF name (blk.{i}.ffn_{gate,up,down}_exps.weight),
    as convert_hf_to_gguf.py merges them; the others as they are."""
    import numpy as np

    kinds = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
    out, stacks = {}, {}
    for name, data in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m is None:
            out[name] = data
            continue
        stacks.setdefault(f"blk.{m.group(1)}.ffn_{kinds[m.group(3)]}_exps.weight", {})[int(m.group(2))] = data
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in sorted(parts)])
    return out


def _gpt_oss_experts(tensors: dict) -> dict:
    """gpt-oss's stacked experts ([experts, in, out], gate and up interleaved) as its converter
    writes them: ffn_{gate,up,down}_exps [experts, out, in] and their biases [experts, out]."""
    import numpy as np

    out = {}
    for name, data in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$", name)
        if m is None:
            out[name] = data
            continue
        layer, kind, bias = m.group(1), m.group(2), m.group(3)
        parts = {"gate": data[..., 0::2], "up": data[..., 1::2]} if kind == "gate_up_proj" else {"down": data}
        for part, values in parts.items():
            values = values if bias else np.ascontiguousarray(np.swapaxes(values, 1, 2))
            out[f"blk.{layer}.ffn_{part}_exps.{'bias' if bias else 'weight'}"] = np.ascontiguousarray(values)
    return out


def _write_phi3_rope(w, config: dict, rope: dict) -> None:
    """As the converter (Phi3MiniModel): the original length and the window always; LongRoPE's
    factors as two F32 tensors and its attention factor from the length ratio (transformers' default;
    the converter ignores an attention_factor of the config)."""
    import math

    import numpy as np

    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(config.get("sliding_window") or 0)
    if not rope.get("long_factor"):
        return
    scale = config["max_position_embeddings"] / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _llama3_rope_factors(rope: dict, base: float, dim: int):
    """llama.cpp's converter's rope_freqs.weight for Llama 3's RoPE scaling: float32 [dim / 2]."""
    import math

    import numpy as np

    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _random_k_blocks(rng, shape: tuple[int, ...], qt):
    """Random blocks of a K-quant or IQ4 type for a [..., rows, cols] tensor (cols a multiple of the
    type's block), their float16 scales set so that the weights stay small."""
    import gguf
    import numpy as np

    *outer, cols = shape
    rows = math.prod(outer)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(RANDOM_BLOCK_SCALES[qt.name]).tobytes(), dtype=np.uint8)
    for at in BLOCK_SCALE_OFFSETS.get(qt.name, (0, 2)):  # (Q4_K, Q5_K: d, dmin first)
        raw[..., at : at + 2 if at + 2 else None] = scale
    return raw.reshape(*outer, -1)


def _write_gguf_tokenizer(w, model_dir: Path) -> None:
    """tokenizer.ggml.* from tokenizer.json (byte-level BPE, llama.cpp's 'gpt2' tokenizer model)."""
    raw = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(raw["model"]["vocab"])
    kinds = {}
    for added in raw.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = 3 if added.get("special") else 4
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([kinds.get(i, 1) for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[eos])
    w.add_eos_token_id(vocab[eos])
    w.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if isinstance(template, int):  # a file that lies (tests): the field as a UINT32
        w.add_uint32("tokenizer.chat_template", template)
    elif template:
        w.add_chat_template(template)
