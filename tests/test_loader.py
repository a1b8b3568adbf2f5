"""Checkpoint loading: sharded files, and every kind of broken checkpoint named in its error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from flover import LLM
from flover.models import CheckpointError
from tests.helpers import rewrite_config


@pytest.fixture
def copy_of(llama_dir, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(llama_dir, target)
    return target


def test_sharded_checkpoint_with_index(llama_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{llama_dir}/{name}", sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").exists()
    ids = [3, 4, 5, 6]
    a = LLM(llama_dir, dtype="float64").engine.score(ids)
    b = LLM(str(sharded), dtype="float64").engine.score(ids)
    assert torch.equal(a, b)


def test_missing_tensor_is_named(copy_of):
    tensors = load_file(copy_of / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, copy_of / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        LLM(str(copy_of))


def test_shape_mismatch_names_tensor_and_file(copy_of):
    tensors = load_file(copy_of / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, copy_of / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' "
        r"has shape \[3, 64\], expected \[32, 64\]",
    ):
        LLM(str(copy_of))


def test_corrupt_file_is_named(copy_of):
    (copy_of / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot read safetensors file"):
        LLM(str(copy_of))


def test_unsupported_architecture_and_bad_config(copy_of):
    rewrite_config(copy_of, architectures=["T5ForConditionalGeneration"])
    with pytest.raises(CheckpointError, match=r"config.json: architecture \['T5ForConditionalGeneration'\] is not"):
        LLM(str(copy_of))
    (copy_of / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        LLM(str(copy_of))


def test_missing_directory_pieces(copy_of, tmp_path):
    with pytest.raises(CheckpointError, match="config.json: not found"):
        LLM(str(tmp_path / "nowhere"))
    (copy_of / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        LLM(str(copy_of))


def test_eos_comes_from_generation_config(copy_of):
    gen = json.loads((copy_of / "generation_config.json").read_text())
    gen["eos_token_id"] = [7, 9]
    (copy_of / "generation_config.json").write_text(json.dumps(gen))
    assert LLM(str(copy_of)).engine.model_config.eos_token_ids == (7, 9)
