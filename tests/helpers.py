"""What several test files share: test checkpoints' settings, real daemons, mpirun, prompt-file runs,
random arrivals. (Test files import from here, never from one another.)"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from flover import LLM, Engine, EngineConfig, SamplingParams
from flover.client import Client
from flover.testing.references import widened_delta_rule

# Small enough that a whole reference comparison takes well under a second.
TEST_PRESET = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


# Gemma 3's two RoPEs: the global layers' (linear scaling), the sliding-window layers' own base
GEMMA3_ROPE = dict(
    full_attention=dict(rope_type="linear", rope_theta=100000.0, factor=2.0),
    sliding_attention=dict(rope_type="default", rope_theta=5000.0),
)

# LongRoPE over half of each head (Phi-3 / Phi-4-mini's settings, in small)
PHI3_LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    short_factor=[1.0, 1.5, 2.0, 3.0],
    long_factor=[2.0, 3.0, 4.0, 6.0],
)

# name -> (arch, config overrides[, preset overrides]): every supported architecture and the
# features that vary.
VARIANTS = {
    "llama": ("llama", {}),
    "llama-mqa-bias-tied-llama3": (
        "llama",
        dict(
            num_key_value_heads=1,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral-window8": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", {}),
    # q/k norms; a head_dim of its own (24: q is 96 wide beside a hidden size of 64)
    "qwen3": ("qwen3", dict(head_dim=24)),
    # Qwen3 attention and 8 experts, 2 a token (renormalised), in layers 0 and 2; layer 1 a dense MLP
    "qwen3-moe": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
        dict(num_layers=3),
    ),
    # Llama attention (q/k rows permuted in GGUF files) and 4 experts of 64, 2 a token, every layer
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    # gpt-oss: attention sinks, q/k/v/o biases, a window of 8 then a full layer, YaRN (4x an original
    # 64 positions); 4 experts of 64 with biases, 2 a token (a softmax over the top 2), the clamped SwiGLU
    "gpt-oss": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=64,
                truncate=False,
            ),
        ),
    ),
    # 4 layers, the 4th without RoPE (SmolLM3's default interval, the one llama.cpp assumes)
    "smollm3": ("smollm3", {}, dict(num_layers=4)),
    # norms after attention and the MLP (none before), q/k norms over each whole projection
    "olmo2": ("olmo2", {}),
    # (1 + w) norms, four a layer, GeGLU, q/k norms, its own score scale and head_dim; 2 sliding-window
    # layers of 8 positions (their own RoPE base) then a global one with linear RoPE scaling
    "gemma3": (
        "gemma3",
        dict(
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters=GEMMA3_ROPE,
        ),
        dict(num_layers=3),
    ),
    # the same as llama.cpp reads a gemma3 file: 7 layers, every 6th global, query_pre_attn_scalar = head_dim
    "gemma3-7": (
        "gemma3",
        dict(
            head_dim=24,
            query_pre_attn_scalar=24,
            sliding_window=8,
            rope_parameters=GEMMA3_ROPE,
        ),
        dict(num_layers=7),
    ),
    # fused qkv_proj / gate_up_proj, RoPE over half of each head, LongRoPE's factors and attention
    # factor (sequences stay within the original length: the short factors, in both)
    "phi3": (
        "phi3",
        dict(
            partial_rotary_factor=0.5,
            original_max_position_embeddings=512,
            rope_parameters=dict(**PHI3_LONGROPE, attention_factor=1.2),
        ),
    ),
    # as llama.cpp's converter writes a phi3 file: LongRoPE's attention factor from the lengths (512 /
    # 128, not in the config), every layer in a 48-position window
    "phi3-gguf": (
        "phi3",
        dict(
            partial_rotary_factor=0.5,
            original_max_position_embeddings=128,
            sliding_window=48,
            rope_parameters=PHI3_LONGROPE,
        ),
    ),
    "gptj": ("gptj", {}),
    # the embeddings times 12, each block's output times 0.22 before the add, scores times 1/32, logits / 8
    "granite": (
        "granite",
        dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03125, logits_scaling=8.0),
    ),
    # Qwen3.5: three Gated DeltaNet layers (2 q/k heads of 16, 4 value heads of 32: two per q/k
    # head) then one full-attention layer with an output gate, RoPE over a quarter of each head
    "qwen3_5": ("qwen3_5", {}, dict(num_layers=4)),
    # and its MoE sibling: 8 experts of 32, 2 a token, plus a shared expert of 64, every layer
    "qwen3_5-moe": ("qwen3_5_moe", {}, dict(num_layers=4)),
    # Gemma 4's E-series: per-layer inputs, the last two layers reading earlier layers' KV (their MLPs
    # twice as wide), global layers with heads of 32 (RoPE over a quarter), logits capped
    "gemma4": ("gemma4", {}),
    # and its MoE (26B-A4B's shape): 4 experts of 32, 2 a token, beside every layer's MLP; the global
    # layer's values its keys' projection, one global kv head; no per-layer inputs, no shared KV
    "gemma4-moe": (
        "gemma4",
        dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    # a vocabulary that does not split evenly over 2 or 4 ranks, 4 kv heads (split, not replicated)
    "llama-vocab509-kv4": ("llama", dict(num_key_value_heads=4), dict(vocab_size=509)),
    # head_dim 80 (not a multiple of 64) and 6 query heads sharing one kv head
    "llama-head80-group6": ("llama", dict(num_key_value_heads=1), dict(hidden_size=480, num_heads=6)),
    # heads of whole blocks of 32 (--kv-dtype's codes): two blocks a row, the heads (4 x 64) wider
    # than hidden and the MLP; and one block, in a sliding window
    "llama-head64": ("llama", dict(head_dim=64)),
    "mistral-window8-head32": ("mistral", dict(sliding_window=8, head_dim=32)),
    # inputs in multiples of 256 (K-quants' super-blocks) for GGUF files of mixed block types,
    # tied embeddings (as SmolLM2's and Llama 3.2's)
    "llama-256": ("llama", {}, dict(hidden_size=256, intermediate_size=512, tie_word_embeddings=True)),
    "qwen3-moe-256": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
        dict(hidden_size=256, intermediate_size=512),
    ),
}

# GGUF name ending -> block type: a file mixing every type whose codes the native step runs, as
# Q4_K_M files mix Q4_K and Q6_K within a layer (a fused q/k/v of two kinds of codes)
GGUF_MIX = {
    "attn_q.weight": "Q4_K",
    "attn_k.weight": "Q4_0",
    "attn_v.weight": "Q6_K",
    "attn_output.weight": "Q5_K",
    "ffn_gate.weight": "Q5_0",
    "ffn_up.weight": "Q5_1",
    "ffn_down.weight": "Q8_0",
    "token_embd.weight": "Q6_K",
}
# ... and the small types of "dynamic" and Q2_K / Q3_K_* files (a fused q/k/v of three kinds of codes)
GGUF_LOW_BITS = {
    "attn_q.weight": "Q3_K",
    "attn_k.weight": "Q2_K",
    "attn_v.weight": "IQ4_NL",
    "attn_output.weight": "IQ4_XS",
    "ffn_gate.weight": "Q2_K",
    "ffn_up.weight": "Q3_K",
    "ffn_down.weight": "IQ4_XS",
    "token_embd.weight": "Q3_K",
}


PROMPTS = [
    "Hello the cat runs fast",
    "A",
    "数据 模型 over the river and far away 12345 " * 3,
    "one two three four five six seven eight nine ten",
]


def rewrite_config(model_dir, **changes) -> None:
    path = f"{model_dir}/config.json"
    with open(path) as f:
        raw = json.load(f)
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        raw.pop(key)
    with open(path, "w") as f:
        json.dump(raw, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: str, *extra: str, ranks: int = 1, script: str | None = None, addr: str | None = None):
        """`script`: a file that runs flover's command line (e.g. with a fault injected)."""
        self.addr = addr or f"tcp://127.0.0.1:{free_port()}"
        args = [
            *([script] if script else ["-m", "flover.apps.cli"]),
            "serve",
            "--model",
            model_dir,
            "--bind",
            self.addr,
            "--dtype",
            "float64",
            "--max-seq-len",
            "256",
            *extra,
        ]
        if ranks > 1:
            cmd, env = mpirun_cmd(ranks, *args), MPI_ENV
        else:
            cmd, env = [sys.executable, *args], {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # "flover serve: ready on ..."
        if not line:  # its stdout closed: it is exiting (wait for it, so that its stderr says why)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        assert "ready on" in line, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")

    def client(self, **kw) -> Client:
        return Client(self.addr, timeout=60, **kw)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.returncode, err


ID_PROMPTS = [[(5 * i + 3 * j) % 500 + 1 for j in range(1 + 3 * i)] for i in range(12)]


def send_id_prompts(client, max_new_tokens: int) -> None:
    """Every ID_PROMPTS prompt to a daemon without waiting, under ids "0", "1", ..."""
    for i, p in enumerate(ID_PROMPTS):
        client.send(
            {
                "op": "generate",
                "id": str(i),
                "input_ids": p,
                "params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
            }
        )


def expected_outputs(model_dir: str, n_tokens: list[int], **params):
    llm = LLM(model_dir, dtype="float64", max_seq_len=256, max_slots=8)
    return llm.generate(ID_PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True, **params) for n in n_tokens])


MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


MPI_ENV = {
    **os.environ,
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl": "self,sm",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "PYTHONUNBUFFERED": "1",
}


def mpirun_cmd(ranks: int, *args: str) -> list[str]:
    return [MPIRUN, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable, *args]


def flover_run_cmd(ranks: int, model_dir: str, prompts, out, *extra: str) -> list[str]:
    args = [
        "-m",
        "flover.apps.cli",
        "run",
        "--model",
        model_dir,
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
        *extra,
    ]
    return mpirun_cmd(ranks, *args) if ranks > 1 else [sys.executable, *args]


def flover_run_ok(ranks: int, model_dir: str, prompts, out, *extra: str, timeout: int = 240):
    """`flover run` on `ranks` ranks (mpirun beyond one; flover_run_cmd's defaults), asserted to
    succeed: the finished process (its stderr holds the start-up lines and the summary)."""
    run = subprocess.run(
        flover_run_cmd(ranks, model_dir, prompts, out, *extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=MPI_ENV,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def tokens_by_id(path) -> dict[str, list[int]]:
    with open(path) as f:
        return {r["id"]: r["token_ids"] for r in map(json.loads, f)}


REQUESTS = [
    {
        "id": f"r{i}",
        "input_ids": [(7 * i + 3 * j) % 500 + 1 for j in range(3 + 5 * i)],
        "max_new_tokens": 8 + 6 * (i % 4),
    }
    for i in range(7)
]


def flover_run(model_dir, prompts, out, *extra, stdin=None, timeout=300):
    cmd = [
        sys.executable,
        "-m",
        "flover.apps.cli",
        "run",
        "--model",
        model_dir,
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-seq-len",
        "128",
        *extra,
    ]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)


def read_records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_jsonl(path, objs) -> None:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))


def random_arrival_jobs(
    seed: int, vocab: int = 512, score_prompts: bool = False, max_new_tokens: int = 40
) -> list[tuple]:
    """14 requests of every length (greedy and seeded sampled) as (arrival iteration, prompt,
    params); prompts of up to 60 tokens. `score_prompts`: about a third also score their prompts
    (prompt_logprobs)."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(14):
        arrives, prompt = rng.randrange(40), [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(
            max_new_tokens=rng.randint(1, max_new_tokens),
            ignore_eos=True,
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(1000),
            prompt_logprobs=score_prompts and rng.random() < 0.3,
        )
        jobs.append((arrives, prompt, params))
    return jobs


def run_arrivals(engine: Engine, jobs: list[tuple]) -> dict:
    """Step `engine` until every job (from random_arrival_jobs) finished, each added at its
    arrival iteration: request id (its index) -> its tokens."""
    finals, iteration = {}, 0
    while len(finals) < len(jobs):
        for i, (arrives, prompt, params) in enumerate(jobs):
            if arrives == iteration:
                engine.add_request(prompt, params, request_id=str(i))
        finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        iteration += 1
    return finals


def run_random_arrivals(model_dir: str, seed: int, cuda_graphs: str, device: str = "cpu") -> tuple[dict, Engine]:
    """random_arrival_jobs into 6 slots of 110 positions, float64: (request id -> tokens, the
    engine). The workload of the static-decode tests here and of the CUDA-graph test in test_cuda.py."""
    engine = Engine(
        EngineConfig(
            model_dir,
            dtype="float64",
            device=device,
            max_slots=6,
            max_batch_tokens=24,
            max_seq_len=110,
            cuda_graphs=cuda_graphs,
        )
    )
    return run_arrivals(engine, random_arrival_jobs(seed)), engine


def conditional_checkpoint(src, out, architecture: str, model_type: str, tower: str):
    """A text checkpoint laid out as the hub's multimodal ones: the text config nested
    (text_config), the weights under model.language_model, a tower's tensor beside them."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    raw = json.loads((src / "config.json").read_text())
    nested = {"architectures": [architecture], "model_type": model_type, "text_config": raw}
    (out / "config.json").write_text(json.dumps(nested))
    tensors = load_file(src / "model.safetensors")
    renamed = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in tensors.items()
    }
    renamed[tower] = torch.zeros(4, 4)
    (out / "model.safetensors").unlink()
    save_file(renamed, out / "model.safetensors")
    return out


def reference_tokens(model_dir: str, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    """transformers' float64 greedy tokens of each prompt alone (experts: its eager loop; Gated
    DeltaNet: its delta rule at float64), the end token not stopping it."""
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    ref.generation_config.eos_token_id = None
    out = []
    with widened_delta_rule(torch.float64), torch.no_grad():
        for ids, n in zip(prompts, new_tokens):
            got = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            out.append(got[0, len(ids) :].tolist())
    return out
