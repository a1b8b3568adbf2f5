"""Careless or hostile model files: every malformed shape or field is one error naming the file and
the field, found before any weight is read or anything large is built; a broken chat template
turns chat off, not the model; a tokenizer that knows ids the model does not is refused per text."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flover import LLM, SamplingParams
from flover.models import CheckpointError, load_model_config
from flover.request import RequestInput
from tests.helpers import Server

gguf = pytest.importorskip("gguf")


def edited_copy(src: str, dst: Path, **config) -> Path:
    """A copy of checkpoint `src` with config.json fields replaced (None: written as null)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(config)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


HF_CASES = [
    (dict(num_key_value_heads=5), "key/value heads"),  # 4 heads: the native step divided by zero
    (dict(num_key_value_heads=3), "key/value heads"),  # read a KV head that does not exist
    (dict(head_dim=31), "head_dim 31"),
    (dict(head_dim=1), "head_dim 1"),
    (dict(num_hidden_layers=300_000_000), "num_hidden_layers must be an integer in"),
    (dict(num_hidden_layers=3), "3 layers, but the weights hold 2"),
    (dict(max_position_embeddings=None), "max_position_embeddings must be an integer"),
    (dict(max_position_embeddings="512"), "max_position_embeddings must be an integer"),
    (dict(max_position_embeddings=1.5), "max_position_embeddings must be an integer"),
    (dict(max_position_embeddings=-4), "max_position_embeddings must be an integer"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be an integer"),
    (dict(max_position_embeddings=1), "no prompt and answer fit"),
    (dict(hidden_size="64"), "hidden_size must be an integer"),
    (dict(num_attention_heads=0), "num_attention_heads must be an integer"),
    (dict(vocab_size=600), r"model.embed_tokens.weight has shape \[512, 64\], config.json says \[600, 64\]"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps must be a number"),
    (dict(eos_token_id="two"), "eos_token_id"),
    (dict(norm_topk_prob="false"), "norm_topk_prob must be true or false, got 'false'"),  # (a string: true)
    (dict(tie_word_embeddings=1), "tie_word_embeddings must be true or false"),
    (dict(partial_rotary_factor="0.5"), "partial_rotary_factor must be a number"),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])  # the native step and PyTorch
def test_malformed_config_json_is_one_error_naming_the_file_and_field(make_model, tmp_path, dtype):
    for i, (fields, message) in enumerate(HF_CASES):
        model = edited_copy(make_model("llama"), tmp_path / f"m{i}", **fields)
        if fields.get("eos_token_id") is not None:
            (model / "generation_config.json").unlink(missing_ok=True)
        with pytest.raises(CheckpointError, match=message) as refused:
            LLM(str(model), dtype=dtype, max_seq_len=64, max_slots=2)
        assert str(model) in str(refused.value), refused.value


def test_a_refused_model_is_one_line_on_the_command_line(make_model, tmp_path):
    model = edited_copy(make_model("llama"), tmp_path / "kv5", num_key_value_heads=5)
    run = subprocess.run(
        [sys.executable, "-m", "flover.apps.cli", "generate", "--model", str(model), "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert f"{model}/config.json" in run.stderr and "key/value heads" in run.stderr


def metadata_only_gguf(path: Path, fields: dict, block_count=2, head_count=4, embedding_length=64) -> Path:
    """A GGUF file of the llama architecture with these header fields and no tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        ("llama.block_count", block_count),
        ("llama.attention.head_count", head_count),
        ("llama.embedding_length", embedding_length),
        ("llama.feed_forward_length", 128),
        ("llama.context_length", 512),
        ("llama.vocab_size", 512),
        *fields.items(),
    ):
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint64(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GGUF_CASES = [
    (dict(block_count=300_000_000), "llama.block_count must be an integer in"),
    (dict(block_count=2_000_000_000), "llama.block_count must be an integer in"),
    (dict(head_count=0), "llama.attention.head_count must be an integer in"),
    (dict(embedding_length="576"), "llama.embedding_length' must be an integer, got '576'"),
    (dict(fields={"general.alignment": 0}), "general.alignment 0 is not a positive multiple of 8"),
    (dict(fields={"llama.attention.head_count_kv": 3}), "key/value heads"),
    (dict(fields={"llama.attention.layer_norm_rms_epsilon": "x"}), "layer_norm_rms_epsilon' must be a number"),
    (
        dict(fields={"llama.expert_count": 0, "llama.expert_used_count": 2}),
        r"llama.expert_count must be an integer in \[1, 1024\], got 0",
    ),
    (dict(), "block_count is 2, but the file holds tensors of 0 layer"),  # a header with no tensors
]


def test_malformed_gguf_headers_are_refused_before_anything_is_built(tmp_path):
    for i, (kwargs, message) in enumerate(GGUF_CASES):
        path = metadata_only_gguf(tmp_path / f"bad{i}.gguf", kwargs.pop("fields", {}), **kwargs)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=message) as refused:
            LLM(str(path), max_seq_len=64, max_slots=2)
        assert str(path) in str(refused.value) and time.monotonic() - started < 20
    # the command line: one line, no traceback, for the 300-million-layer header
    run = subprocess.run(
        [sys.executable, "-m", "flover.apps.cli", "generate", "--model", str(tmp_path / "bad0.gguf"), "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr and "block_count" in run.stderr, run.stderr[-2000:]
    with pytest.raises(CheckpointError, match="block_count"):
        load_model_config(tmp_path / "bad0.gguf")


def test_a_broken_chat_template_turns_chat_off_not_the_model(make_model, tmp_path):
    model = Path(shutil.copytree(make_model("llama"), tmp_path / "broken-template"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }"  # a syntax error
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    llm = LLM(str(model), dtype="float64", max_seq_len=64, max_slots=2)
    plain = llm.generate(["Hello the cat"], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(plain[0].token_ids) == 3
    with pytest.raises(ValueError, match="chat template is broken .*send a plain prompt"):
        llm.engine.make_request(RequestInput(None, messages=[{"role": "user", "content": "hi"}]))


def test_a_tokenizer_id_outside_the_model_is_refused_and_nothing_else_fails(make_model, tmp_path):
    """tokenizer.json gains a token with id 700 while the model has 512 rows: a text holding it is
    refused at intake on every path; a request beside it is served."""
    model = Path(shutil.copytree(make_model("llama"), tmp_path / "big-tokenizer"))
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["added_tokens"].append(
        {
            "id": 700,
            "content": "<extra>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    )
    (model / "tokenizer.json").write_text(json.dumps(spec))
    for dtype in ("float32", "float64"):
        llm = LLM(str(model), dtype=dtype, max_seq_len=64, max_slots=2)
        with pytest.raises(ValueError, match=r"token id \d+, outside the model's vocabulary of 512"):
            llm.engine.make_request(RequestInput("Hello <extra> cat"))
    for ranks in (1, 2):  # under mpirun the followers never see the ids: the job stays up
        server = Server(str(model), "--dtype", "float32", ranks=ranks)
        try:
            with server.client() as c:
                with pytest.raises(Exception, match="outside the model's vocabulary"):
                    c.generate("Hello <extra> cat", max_new_tokens=3)
                ok = c.generate("Hello the cat", max_new_tokens=3, ignore_eos=True)
                assert len(ok["token_ids"]) == 3
        finally:
            code, err = server.stop(signal.SIGUSR1 if ranks > 1 else signal.SIGTERM)  # mpirun forwards USR1
        assert code == 0, err[-2000:]


def _tensor_bytes(path: Path, name: str) -> tuple[int, int]:
    """(where tensor `name`'s data starts in the file, where its offset field is in the header)."""
    from flover.models.gguf_file import parse_gguf

    _, tensors, raw = parse_gguf(path)
    start = tensors[name].data.__array_interface__["data"][0] - raw.__array_interface__["data"][0]
    head = path.read_bytes()[:start]
    key = len(name).to_bytes(8, "little") + name.encode()
    at = head.index(key) + len(key)
    n_dims = int.from_bytes(head[at : at + 4], "little")
    return start, at + 4 + 8 * n_dims + 4


def _patched(src: Path, dst: Path, at: int, data: bytes) -> Path:
    blob = bytearray(src.read_bytes())
    blob[at : at + len(data)] = data
    dst.write_bytes(bytes(blob))
    return dst


@pytest.fixture(scope="module")
def q8_file(make_model, tmp_path_factory) -> Path:
    from flover.testing.tiny_model import write_gguf

    return Path(write_gguf(make_model("llama"), tmp_path_factory.mktemp("q8") / "m.gguf", "Q8_0"))


@pytest.mark.parametrize("quantization", ["none", "auto"])  # dequantized, and the file's own codes where they run
def test_non_finite_scales_and_weights_are_refused_at_load_naming_the_tensor(q8_file, tmp_path, quantization):
    import numpy as np

    start, _ = _tensor_bytes(q8_file, "blk.0.attn_q.weight")
    nan_scale = _patched(q8_file, tmp_path / "nan.gguf", start, np.float16("nan").tobytes())  # the first block's d
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.weight holds .*not finite"):
        LLM(str(nan_scale), max_seq_len=64, max_slots=2, quantization=quantization)
    norm, _ = _tensor_bytes(q8_file, "blk.1.ffn_norm.weight")
    inf_norm = _patched(q8_file, tmp_path / "inf.gguf", norm + 4, np.float32("inf").tobytes())
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_norm\.weight holds values that are not finite"):
        LLM(str(inf_norm), max_seq_len=64, max_slots=2, quantization=quantization)


@pytest.mark.parametrize("quantization", ["none", "file"])
def test_mxfp4_scale_bytes_254_and_255_are_refused_naming_the_tensor(make_model, tmp_path, quantization):
    """E8M0 255 is NaN (OCP MX); 254 (2^126) is finite but overflows every sum: both refused, with
    the file's codes and dequantized; the file as written loads."""
    from flover.testing.tiny_model import write_gguf

    path = Path(write_gguf(make_model("gpt-oss"), tmp_path / "m.gguf", "Q8_0", types={"_exps.weight": "MXFP4"}))
    start, _ = _tensor_bytes(path, "blk.1.ffn_down_exps.weight")
    for byte, why in ((255, "not finite"), (254, "leave float32's range")):
        bad = _patched(path, tmp_path / f"e{byte}.gguf", start + 17, bytes([byte]))  # the second block's scale
        with pytest.raises(CheckpointError, match=rf"blk\.1\.ffn_down_exps\.weight holds .*{why}"):
            LLM(str(bad), max_seq_len=64, max_slots=2, quantization=quantization)
    LLM(str(path), max_seq_len=64, max_slots=2, quantization=quantization)


def test_tensor_offsets_must_be_aligned_in_bounds_and_apart(q8_file, tmp_path):
    from flover.models.gguf_file import parse_gguf

    _, field = _tensor_bytes(q8_file, "blk.0.attn_k.weight")
    offset = int.from_bytes(q8_file.read_bytes()[field : field + 8], "little")
    shifted = _patched(q8_file, tmp_path / "shifted.gguf", field, (offset + 3).to_bytes(8, "little"))
    with pytest.raises(CheckpointError, match="not a multiple of general.alignment"):
        LLM(str(shifted), max_seq_len=64, max_slots=2)
    _, other = _tensor_bytes(q8_file, "blk.0.attn_q.weight")
    q_offset = int.from_bytes(q8_file.read_bytes()[other : other + 8], "little")
    aliased = _patched(q8_file, tmp_path / "aliased.gguf", field, q_offset.to_bytes(8, "little"))
    with pytest.raises(CheckpointError, match="overlap"):
        LLM(str(aliased), max_seq_len=64, max_slots=2)
    parse_gguf(q8_file)  # the file as written passes
