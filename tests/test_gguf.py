"""GGUF checkpoints: files the tests write themselves (llama.cpp's layout, the `gguf` package's
writer and quantizers) from small random checkpoints, loaded by flover and by transformers
(`from_pretrained(dir, gguf_file=...)`, which dequantizes the same way) and compared."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from flover import LLM, SamplingParams
from flover.models import CheckpointError, load_model, load_model_config, open_checkpoint
from flover.testing.tiny_model import make_tiny_model, write_gguf
from tests.helpers import MPI_ENV, MPIRUN, PROMPTS, TEST_PRESET, mpirun_cmd, widened_delta_rule

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello the cat runs fast"}]


@pytest.fixture(scope="session")
def gguf_file(make_model, tmp_path_factory):
    """gguf_file(variant, qtype) -> path of a GGUF written from that test checkpoint."""
    made = {}

    def make(variant: str, qtype: str) -> str:
        if (variant, qtype) not in made:
            out = tmp_path_factory.mktemp(f"gguf-{variant}") / f"{variant}-{qtype}.gguf"
            made[variant, qtype] = str(write_gguf(make_model(variant), out, qtype))
        return made[variant, qtype]

    return make


def reference(path: str, dtype: torch.dtype, config=None):
    """transformers' own reading of the file. `config`: the checkpoint's, where transformers'
    GGUF mapping loses a field (qwen3's attention.key_length: its head_dim of its own)."""
    from pathlib import Path

    p = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype, config=config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return model.eval(), tokenizer


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # (as ignore_eos: else min_new_tokens masks the end token out)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


# files transformers cannot read (or reads losing a field): compared with the directory they came from
DIRECTORY_REFERENCE = (
    "smollm3",
    "olmo2",
    "gemma3-7",
    "phi3-gguf",
    "qwen3-moe",
    "mixtral",
    "gpt-oss",
    "granite",
    "qwen3_5",
    "qwen3_5-moe",
    "gemma4",
    "gemma4-moe",
)


@pytest.mark.parametrize(
    "variant,qtype,dtype",
    [
        ("llama", "F32", "float64"),
        ("llama", "Q8_0", "float64"),
        ("llama", "Q4_0", "float64"),
        ("llama", "Q8_0", "float32"),
        ("llama", "Q4_1", "float32"),
        ("llama", "F16", "float32"),
        ("qwen2", "Q8_0", "float64"),
        ("qwen3", "F32", "float64"),
        ("qwen3", "Q8_0", "float64"),
        ("smollm3", "F32", "float64"),
        ("olmo2", "F32", "float64"),
        ("gemma3-7", "F32", "float64"),
        ("phi3-gguf", "F32", "float64"),
        ("llama-vocab509-kv4", "Q4_0", "float32"),
        ("qwen3-moe", "F32", "float64"),
        ("mixtral", "F32", "float64"),
        ("gpt-oss", "F32", "float64"),
        ("granite", "F32", "float64"),
        ("qwen3_5", "F32", "float64"),
        ("qwen3_5-moe", "F32", "float64"),
        ("gemma4", "F32", "float64"),
        ("gemma4-moe", "F32", "float64"),
    ],
)
def test_greedy_tokens_and_logits_equal_transformers_on_the_same_file(gguf_file, make_model, variant, qtype, dtype):
    path = gguf_file(variant, qtype)
    torch_dtype = getattr(torch, dtype)
    if variant in DIRECTORY_REFERENCE:
        assert qtype == "F32"  # (the directory)
        ref = transformers.AutoModelForCausalLM.from_pretrained(  # (experts: the eager loop runs float64)
            make_model(variant), dtype=torch_dtype, experts_implementation="eager"
        ).eval()
        # (its tokenizer.json as it is: AutoTokenizer swaps in Qwen3.5's own pre-tokenizer for qwen3_5_moe)
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(make_model(variant))
    else:
        config = transformers.AutoConfig.from_pretrained(make_model(variant)) if variant == "qwen3" else None
        ref, tok = reference(path, torch_dtype, config)
    llm = LLM(path, dtype=dtype, max_slots=8, max_seq_len=128)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    for prompt in prompts:
        assert llm.engine.tokenizer.encode(PROMPTS[prompts.index(prompt)]) == prompt  # same tokenizer
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    with widened_delta_rule(torch_dtype):  # (Qwen3.5's reference: its delta rule at float64)
        assert [o.token_ids for o in outs] == [greedy_reference(ref, p, 10) for p in prompts]
        with torch.no_grad():
            expected = ref(torch.tensor([prompts[2]])).logits[0]
    got = llm.engine.score(prompts[2])
    bound = 1e-9 if dtype == "float64" else 2e-3
    assert (got.to(expected.dtype) - expected).abs().max().item() < bound


def test_llama3_rope_from_the_files_frequency_factors_equals_transformers(tmp_path):
    """Llama 3.x GGUF files carry their RoPE scaling as rope_freqs.weight (per-dimension divisors,
    written by llama.cpp's converter); flover divides its frequencies by them and gives the
    logits transformers gives on the Hugging Face directory with rope_type llama3, at positions
    where the scaling matters."""
    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    model_dir = make_tiny_model("llama", TEST_PRESET, tmp_path / "llama3", rope_parameters=rope)
    path = write_gguf(model_dir, tmp_path / "llama3.gguf", "F32")
    assert "rope_freqs.weight" in open_checkpoint(path).tensors
    assert open_checkpoint(path).model_config().rope_scaling["rope_type"] == "freq_factors"
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [(7 * i) % 500 + 3 for i in range(90)]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = LLM(str(path), dtype="float32", max_slots=2, max_seq_len=128).engine.score(ids)
    assert (got - expected).abs().max().item() < 1e-5
    plain = LLM(
        str(write_gguf(make_tiny_model("llama", TEST_PRESET, tmp_path / "plain"), tmp_path / "p.gguf", "F32")),
        dtype="float32",
        max_slots=2,
        max_seq_len=128,
    ).engine.score(ids)
    assert (plain - expected).abs().max().item() > 1e-3  # the scaling changes these logits


def test_the_files_pages_leave_the_process_once_the_weights_are_copied(gguf_file):
    """The file stays mapped (its metadata, a later read), but the pages loading read are dropped
    from the process: otherwise resident memory counts the whole file beside the weights' copies."""
    path = gguf_file("llama", "Q8_0")

    def resident_kib() -> int:
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            if line[0] in "0123456789abcdef" and " " in line and "-" in line.split()[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total

    checkpoint = open_checkpoint(path)  # held, as the engine holds it
    load_model(checkpoint, torch.float32, torch.device("cpu"), 64)
    assert sum(t.data.size for t in checkpoint.tensors.values()) > 64 * 1024  # loading read more than that
    assert resident_kib() <= 16, resident_kib()
    assert torch.equal(
        torch.from_numpy(checkpoint.tensors["blk.0.ffn_down.weight"].dequantize()),
        load_model(checkpoint, torch.float32, torch.device("cpu"), 64, pack=False).layers[0].down.weight,
    )


def test_tokenizer_and_chat_template_equal_transformers_gguf_conversion(gguf_file):
    path = gguf_file("llama", "Q8_0")
    _, tok = reference(path, torch.float32)
    ours = open_checkpoint(path)
    from flover.models.tokenizer import load_tokenizer

    mine = load_tokenizer(ours)
    texts = PROMPTS + ["  two  spaces\n\nand\ttabs", "<|endoftext|> inside", "über café 東京 ✓ 12345", ""]
    for text in texts:
        assert mine.encode(text) == tok(text)["input_ids"], text
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert mine.encode_chat(CHAT) == rendered["input_ids"]
    ids = mine.encode(PROMPTS[2])
    assert mine.decode(ids) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL"])
def test_k_quant_tensors_dequantize_as_transformers_does(tmp_path, qtype):
    """The gguf package cannot quantize to K-quants, so the tensors hold random blocks with sane
    scales; flover and transformers must read the same weights out of them."""
    model_dir = make_tiny_model(
        "llama",
        {**TEST_PRESET, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2},
        tmp_path / "m",
    )
    path = write_gguf(model_dir, tmp_path / f"k-{qtype}.gguf", qtype)  # every 2-D tensor: random blocks
    ref, _ = reference(str(path), torch.float32)
    llm = LLM(str(path), dtype="float32", max_slots=2, max_seq_len=64)
    ckpt = open_checkpoint(path)
    reader = ckpt.reader(ckpt.model_config())
    from flover.models.safetensors_reader import Source

    state = ref.state_dict()
    compared = 0
    for name, expected in state.items():
        if reader.has(name) and expected.dim() == 2:
            got = reader.read(Source(name, tuple(expected.shape)))
            assert torch.equal(got, expected.float()), name
            compared += 1
    assert compared >= 9
    prompt = [5, 6, 7, 8]
    out = llm.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    assert out == greedy_reference(ref, prompt, 6)


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun")
def test_tp2_on_a_gguf_file_gives_the_tp1_tokens(gguf_file, tmp_path):
    path = gguf_file("llama", "Q4_0")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"tp{ranks}.jsonl"
        args = [
            "-m",
            "flover.apps.cli",
            "run",
            "--model",
            path,
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--dtype",
            "float64",
            "--max-seq-len",
            "128",
            "--token-ids",
            "--ignore-eos",
            "--quiet",
            "--max-new-tokens",
            "8",
        ]
        cmd = mpirun_cmd(ranks, *args) if ranks > 1 else [sys.executable, *args]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=MPI_ENV)
        assert run.returncode == 0, run.stderr[-3000:]
        results[ranks] = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert len(results[1]) == len(PROMPTS) and results[2] == results[1]


def test_unsupported_files_say_what_and_where(make_model, tmp_path):
    import gguf

    bad_arch = tmp_path / "phi2.gguf"
    w = gguf.GGUFWriter(str(bad_arch), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=f"{bad_arch}: architecture 'phi2' is not supported"):
        load_model_config(bad_arch)

    ternary = tmp_path / "tq2.gguf"
    write_gguf(make_model("llama-256"), ternary, "TQ2_0")  # (blocks of 256)
    with pytest.raises(CheckpointError, match=r"tq2.gguf: tensor .* has type TQ2_0, which flover does not read"):
        LLM(str(ternary), max_seq_len=64)

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(200)))
    run = subprocess.run(
        [sys.executable, "-m", "flover.apps.cli", "generate", "--model", str(garbage), "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr and f"{garbage}: not a readable GGUF" in run.stderr


@pytest.mark.parametrize(
    "qtype",
    ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "MXFP4", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"],
)
def test_block_grids_give_the_values_the_gguf_package_dequantizes(qtype):
    """Random blocks (sane f16 scales, every other byte random) -> codes, scales and minimums
    (models/gguf_grids.py): scale * q + low is gguf's dequantization bit for bit, and the codes
    span their type's range."""
    import gguf

    from flover.models.gguf_grids import BLOCK_TYPES, block_grid

    size, per_block, group, bits, _ = BLOCK_TYPES[qtype]
    rng = np.random.default_rng(1)
    rows, cols = 8, 512
    raw = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    scales = {
        "Q6_K": [208],
        "Q4_1": [0, 2],
        "Q5_1": [0, 2],
        "Q4_K": [0, 2],
        "Q5_K": [0, 2],
        "Q2_K": [80, 82],
        "Q3_K": [108],
    }.get(qtype, [0])
    for at in scales if qtype != "MXFP4" else ():
        raw[:, at : at + 2] = rng.uniform(-0.05, 0.05, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == "MXFP4":  # (its scale: one byte, an exponent: 0 to 127, and the largest three)
        raw[:, 0] = np.arange(raw.shape[0]) % 256
        raw[-3:, 0] = [251, 252, 255]
    grid = block_grid(qtype, raw.reshape(-1), (rows, cols))
    expected = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[qtype])
    if qtype == "MXFP4":  # scale byte 255 is E8M0's NaN (the OCP spec; gguf reads 2^127): refused at load
        nan = (raw[:, 0] == 255).repeat(per_block).reshape(rows, cols)
        assert np.isnan(grid.values()[nan]).all() and nan.any()
        expected[nan] = np.nan
        assert np.array_equal(grid.values(), expected, equal_nan=True)
        grid.scale[np.isnan(grid.scale)] = 2.0**127
        expected[nan] = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[qtype])[nan]
    assert np.array_equal(grid.values(), expected) and np.array_equal(grid.values_tensor().numpy(), expected)
    assert grid.group == group and grid.scale.shape == (rows, cols // group)
    low, high = {
        "Q4_0": (0, 15),
        "Q4_1": (0, 15),
        "Q4_K": (0, 15),
        "Q5_0": (-16, 15),
        "Q5_1": (0, 31),
        "Q5_K": (0, 31),
        "Q6_K": (-32, 31),
        "Q8_0": (-128, 127),
        "MXFP4": (-12, 12),
        "Q2_K": (0, 3),
        "Q3_K": (-4, 3),
        "IQ4_NL": (-127, 113),
        "IQ4_XS": (-127, 113),
    }[qtype]
    assert (grid.codes.min(), grid.codes.max()) == (low, high) and grid.bits == (4 if (low, high) == (0, 15) else 8)
    if qtype.startswith("IQ4"):  # codes: the 16 values of its table, no others
        assert len(np.unique(grid.codes)) == 16
    if qtype in ("Q4_K", "Q5_K", "Q2_K"):  # the factors the kernels read give the scales and minimums bit for bit
        d, neg_dmin, sc, m = grid.supers
        per = sc.shape[1] // d.shape[1]  # groups per super-block: 8, Q2_K's 16
        assert np.array_equal(np.repeat(d, per, axis=1) * sc.astype(np.float32), grid.scale)
        assert np.array_equal(np.repeat(neg_dmin, per, axis=1) * m.astype(np.float32), grid.low)
        assert sc.max() <= (15 if qtype == "Q2_K" else 63) and m.max() <= (15 if qtype == "Q2_K" else 63)
    if qtype in ("Q6_K", "Q3_K", "IQ4_XS"):  # signed scales (Q3_K's, IQ4_XS's: the file's 6 bits less 32)
        d, sc = grid.supers
        assert sc.dtype == np.int8 and sc.shape == grid.scale.shape
        assert qtype == "Q6_K" or (sc.min() >= -32 and sc.max() <= 31)
        assert np.array_equal(np.repeat(d, sc.shape[1] // d.shape[1], axis=1) * sc.astype(np.float32), grid.scale)


def test_quantization_file_takes_every_block_type_it_runs_and_names_the_others(make_model, gguf_mix, tmp_path):
    """auto keeps a file's codes only where every projection is in a type the kernels run; an F16
    projection among them means none (dequantized), and asking for "file" there, or on a
    Hugging Face directory, is refused naming the tensor."""
    from flover import Engine, EngineConfig
    from tests.helpers import GGUF_MIX

    model = load_model(gguf_mix, torch.bfloat16, torch.device("cpu"), 64, quantization="file", pack=False)
    reader = open_checkpoint(gguf_mix)
    kinds = [(g.bits, g.group, g.low is None, g.supers is not None) for g in model.layers[0].qkv.quantized.parts]
    # q (Q4_K: its super-blocks' factors too), k (Q4_0), v (Q6_K, with its factors): three runs of codes
    assert kinds == [(4, 32, False, True), (4, 32, False, False), (8, 16, True, True)]
    values = load_model(gguf_mix, torch.float32, torch.device("cpu"), 64, pack=False)
    for got, want in zip(model.modules(), values.modules()):  # the file's values, each rounded to bfloat16 once
        if getattr(got, "quantized", None) is not None:
            assert torch.equal(got.weight, want.weight.to(torch.bfloat16))
    assert reader.projection_types() == set(GGUF_MIX.values())
    with_f16 = tmp_path / "with-f16.gguf"
    write_gguf(make_model("llama-256"), with_f16, "Q4_K", types={**GGUF_MIX, "ffn_up.weight": "F16"})
    engine = Engine(EngineConfig(str(with_f16), dtype="bfloat16", max_slots=2, max_seq_len=64))
    assert engine.config.quantization == "none"
    with pytest.raises(
        CheckpointError,
        match=r"--quantization file: model.layers.0.mlp.up_proj.weight is not in "
        r"blocks whose codes flover runs",
    ):
        Engine(EngineConfig(str(with_f16), dtype="bfloat16", quantization="file", max_slots=2, max_seq_len=64))
    with pytest.raises(CheckpointError, match="keeps a GGUF file's codes"):
        Engine(EngineConfig(make_model("llama"), dtype="bfloat16", quantization="file", max_slots=2, max_seq_len=64))


def file_codes(path: str, name: str) -> torch.Tensor:
    """The 4-bit codes of a Q4_0 / Q4_1 tensor as stored: [rows, cols] uint8 (each block of 32:
    low nibbles are its first 16 values, high nibbles the next 16)."""
    t = open_checkpoint(path).tensors[name]
    q4_0 = t.type_name == "Q4_0"
    blocks = t.data.reshape(-1, 18 if q4_0 else 20)[:, 2 if q4_0 else 4 :]  # 2 (+ 2) bytes of scale (and minimum)
    codes = np.concatenate([blocks & 0x0F, blocks >> 4], axis=1)
    return torch.from_numpy(codes.reshape(t.shape).astype(np.uint8))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
def test_a_4bit_file_runs_on_its_own_codes_where_the_native_step_runs_bfloat16(make_model, gguf_file, tmp_path, qtype):
    """--quantization auto (the default) on a Q4_1 or Q4_0 file in bfloat16: the projections keep
    the file's 4-bit codes and scales (read as they are: here every group's values sit near 3,
    where bfloat16's step is wider than the file's, so rounding first would lose them; Q4_0's
    grid is not the one quantizing its values would pick) and run the native step's int4
    kernels; none dequantizes them; an F16 file stays 16-bit. The demo model's answers depend
    on the head keeping the file's values (not quantized again): tests/test_real_model.py's demo test."""
    import shutil

    from safetensors.torch import load_file, save_file

    from flover import Engine, EngineConfig

    model_dir = tmp_path / "offset"
    shutil.copytree(make_model("llama"), model_dir)
    weights = next(model_dir.glob("*.safetensors"))
    tensors = load_file(weights)
    for name in tensors:
        if name.endswith(("down_proj.weight", "o_proj.weight")):
            tensors[name] += 3.0
    save_file(tensors, weights)
    path = str(write_gguf(model_dir, tmp_path / f"offset-{qtype}.gguf", qtype))
    engine = Engine(EngineConfig(path, dtype="bfloat16", max_slots=2, max_seq_len=64))
    assert engine.config.quantization == "file"
    # the file's head is in blocks of codes already: it keeps them too (not quantized again per
    # row), and greedy rows take its logits (no screen: the codes are the cheaper copy)
    assert engine.runner.native is not None and engine.runner.native.quantized_projections == 2 * 4 + 1
    assert not engine.runner.native.screens_greedy
    model = load_model(path, torch.bfloat16, torch.device("cpu"), 64, quantization="int4", pack=False)
    for layer, name in (
        (model.layers[0].down, "blk.0.ffn_down.weight"),
        (model.layers[1].o, "blk.1.attn_output.weight"),
    ):
        assert torch.equal(layer.quantized.codes, file_codes(path, name)), name
        t = open_checkpoint(path).tensors[name]
        d = torch.from_numpy(
            t.data.reshape(-1, 18 if qtype == "Q4_0" else 20)[:, :2].copy().view(np.float16).astype(np.float32)
        )
        assert torch.equal(layer.quantized.exact_scales[..., 0].t().reshape(-1), d.reshape(-1)), name  # its own scales
    # Q and K rows un-permuted with their codes, every projection: the values the file holds
    values = load_model(path, torch.float32, torch.device("cpu"), 64, pack=False)
    for got, want in zip(model.modules(), values.modules()):
        if getattr(got, "quantized", None) is not None and got is not model.lm_head:
            assert torch.allclose(got.weight.float(), want.weight, rtol=2**-7, atol=1e-6)
    # and the model they make (the plain test model's file: bfloat16 against float32)
    plain, ids = gguf_file("llama", qtype), [5, 6, 7, 8, 9, 10]
    exact = Engine(EngineConfig(plain, dtype="float32", max_slots=2, max_seq_len=64)).score(ids)
    int4 = Engine(EngineConfig(plain, dtype="bfloat16", max_slots=2, max_seq_len=64))
    assert int4.config.quantization == "file"
    assert (int4.score(ids).float() - exact).abs().max() < 0.05 * exact.abs().max()
    assert (
        Engine(
            EngineConfig(path, dtype="bfloat16", quantization="none", max_slots=2, max_seq_len=64)
        ).config.quantization
        == "none"
    )
    assert (
        Engine(
            EngineConfig(gguf_file("llama", "F16"), dtype="bfloat16", max_slots=2, max_seq_len=64)
        ).config.quantization
        == "none"
    )
    assert Engine(EngineConfig(path, dtype="float32", max_slots=2, max_seq_len=64)).config.quantization == "none"
