"""Check a family end to end the way users get its files: a tiny random checkpoint of it (SmolLM2's
tokenizer, which llama.cpp's converter recognizes), converted by llama.cpp's own
convert_hf_to_gguf.py, then flover in float64 on the directory and on the GGUF file against
transformers on the directory: greedy tokens of several prompts run fused in one engine, and the
largest logit difference. (The tests do the same with flover.testing's GGUF writer; this is the
check against the converter people use. docs/architecture.md, "Adding a family".)

    python scripts/check_family.py granite --llama-cpp DIR/vendor/llama.cpp \
        --tokenizer-gguf ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf \
        --set embedding_multiplier=12 residual_multiplier=0.22 attention_multiplier=0.03125 logits_scaling=8

Needs the `compare` extra (transformers; sentencepiece and protobuf for the converter).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from flover import LLM, SamplingParams
from flover.testing.references import widened_delta_rule
from flover.testing.tiny_model import hf_config, slow_decays, train_spm_style_tokenizer

PRESET = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPTS = [
    "Hello, the cat runs fast",
    "A",
    "One two three four five six seven eight nine ten",
    "数据 模型 over the river",
]


def make_checkpoint(family: str, tokenizer_gguf: Path | None, out: Path, overrides: dict) -> None:
    """Random weights (seed 0) in the family's config class, SmolLM2's tokenizer (Gemma 4: a
    byte-fallback BPE of Gemma's kind, which its converter wants)."""
    if family in SPM_TOKENIZER:
        special = dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=train_spm_style_tokenizer(768), **special)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_gguf.parent, gguf_file=tokenizer_gguf.name)
    preset = {**PRESET, "vocab_size": len(tok), "max_position_embeddings": 512, "tie_word_embeddings": False}
    config = hf_config(family, preset, tok.eos_token_id, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    slow_decays(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)


# what the converter needs beyond the directory: random Qwen3.5 checkpoints have no MTP head
CONVERTER_FLAGS = {"qwen3_5": ["--no-mtp"], "qwen3_5_moe": ["--no-mtp"]}
# the converter checks the tokenizer by loading it with AutoTokenizer, which picks Qwen3.5-MoE's
# own class (another pre-tokenizer) by the config's model_type: told it is SmolLM2's, which it is
PRE_TOKENIZER = {"qwen3_5_moe": "smollm"}
SPM_TOKENIZER = {"gemma4"}  # (its converter reads tokenizer.json as Gemma's: byte-fallback BPE)


def convert(family: str, hf: Path, llama_cpp: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{llama_cpp / 'gguf-py'}{os.pathsep}{llama_cpp}"}
    script = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py")]
    if family in PRE_TOKENIZER:
        patch = (
            "import runpy, sys; import conversion.base as b; "
            f"b.TextModel.get_vocab_base_pre = lambda self, tokenizer: {PRE_TOKENIZER[family]!r}; "
            "script = sys.argv[1]; sys.argv = sys.argv[1:]; runpy.run_path(script, run_name='__main__')"
        )
        script = [sys.executable, "-c", patch, script[1]]
    cmd = [*script, str(hf), "--outtype", "f32", "--outfile", str(out), *CONVERTER_FLAGS.get(family, [])]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def compare(model: str, ref, tok, new_tokens: int = 24) -> dict:
    """flover (float64, every prompt fused in one engine) against transformers' greedy tokens, one
    prompt at a time, and the largest |logit difference| over a prompt."""
    llm = LLM(model, dtype="float64", max_slots=4, max_seq_len=256)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ours = [llm.tokenizer.encode(p) for p in PROMPTS]  # (a GGUF file's tokenizer may add a BOS)
    tokens_equal = sum(o == p or o[1:] == p for o, p in zip(ours, prompts))
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    ref.generation_config.eos_token_id = None
    same = 0
    with widened_delta_rule(torch.float64), torch.no_grad():  # (Qwen3.5's delta rule at float64 too)
        for prompt, out in zip(prompts, outs):
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt) :]
            same += out.token_ids == want.tolist()
        expected = ref(torch.tensor([prompts[0]])).logits[0]
    diff = (llm.engine.score(prompts[0]).double() - expected).abs().max().item()
    return {
        "tokenized alike": f"{tokens_equal}/{len(prompts)}",
        "greedy prompts equal": f"{same}/{len(prompts)}",
        "max |logit diff|": f"{diff:.2e}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", help="a file of flover/models/families (its name)")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source (convert_hf_to_gguf.py)")
    parser.add_argument("--tokenizer-gguf", type=Path, help="a GGUF file with SmolLM2's tokenizer (not for gemma4)")
    parser.add_argument("--set", nargs="*", default=[], help="config.json fields KEY=JSON for the checkpoint")
    args = parser.parse_args()
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    with tempfile.TemporaryDirectory() as tmp:
        hf, gguf = Path(tmp) / "hf", Path(tmp) / f"{args.family}-f32.gguf"
        make_checkpoint(args.family, args.tokenizer_gguf, hf, overrides)
        convert(args.family, hf, args.llama_cpp, gguf)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float64, experts_implementation="eager"
        ).eval()
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(hf)  # (its tokenizer.json as it is)
        for name, model in (("directory", hf), ("llama.cpp's GGUF", gguf)):
            print(f"{args.family} {name}: {compare(str(model), ref, tok)}")


if __name__ == "__main__":
    main()
