"""`flover` command line: `flover generate` (offline, in-process engine)."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from flover.chat_template import TemplateLimits
from flover.config import DTYPES, NATIVE_KERNELS, QUANTIZATIONS, EngineConfig, SamplingParams
from flover.protocol import MAX_MESSAGE_BYTES
from flover.structured.spec import GrammarLimits

log = logging.getLogger("flover")


def add_engine_args(ap: argparse.ArgumentParser, model_required: bool = True) -> None:
    g = ap.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=model_required,
        help="a GGUF file, a Hugging Face checkpoint directory, or a hub id ORG/NAME (from the local "
        "hub cache, downloaded where a hub is reachable)",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto (default): bfloat16 where the CPU/GPU computes it natively, else float32",
    )
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="weight-only int8/int4 projections for fast single streams (CPU, bfloat16); file: a GGUF "
        "file's projections keep their own codes (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0); "
        "auto (default): file where the native step runs in bfloat16 and the file allows, else "
        "none (none: dequantized to the dtype)",
    )
    g.add_argument("--max-slots", type=int, default=32, help="requests in flight at once")
    g.add_argument(
        "--max-seq-len", type=int, default=None, help="prompt + output tokens (default: model limit, <= 2048)"
    )
    g.add_argument("--max-batch-tokens", type=int, default=512, help="token budget of one iteration")
    g.add_argument(
        "--prompt-first",
        type=int,
        default=3,
        metavar="N",
        help="while prompts wait, up to N iterations in a row run prompt tokens alone before the running "
        "requests decode again (lower time to first token under bursts; default 3; 0: every "
        "iteration decodes)",
    )
    g.add_argument(
        "--prompt-first-tokens", type=int, default=192, help="prompt tokens of one such iteration (default 192)"
    )
    g.add_argument(
        "--speculate",
        type=int,
        default=None,
        metavar="K",
        help="prompt-lookup speculation: greedy requests draft up to K tokens per iteration from where "
        "their last tokens occurred before (prompt or output), checked by the same forward: the "
        "same tokens in fewer iterations (default: 8 where the native CPU step runs, on every "
        "rank under TP; else off; 0: off)",
    )
    g.add_argument(
        "--speculate-ngram",
        type=int,
        default=3,
        metavar="N",
        help="the last N tokens are looked up for a draft (default 3)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="T",
        help="under mpirun -np N: ranks per engine (tensor parallel inside it); N / T engine groups "
        "(data parallel) behind world rank 0 (default: one engine of all N ranks)",
    )
    g.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="P",
        help="under mpirun -np N: pipeline stages per engine, each a contiguous range of layers on "
        "--tp ranks; up to P iterations in flight over disjoint requests; N / (P x T) engine groups "
        "(default 1: no pipeline)",
    )
    g.add_argument(
        "--stage-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="pipeline stages: a stage whose rows do not come back within S seconds (frozen, its host "
        "gone silent) ends the job: every request in flight gets an engine_unresponsive error first",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the cores available, shared by the ranks on this node)",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed")
    g.add_argument(
        "--prefix-cache",
        type=float,
        default=256,
        metavar="MIB",
        help="MiB (per rank) of KV blocks of recent prompts kept for reuse by later prompts that start "
        "the same way (LRU; default 256; 0 turns it off)",
    )
    g.add_argument(
        "--full-window-kv",
        action="store_true",
        help="sliding-window layers (Gemma 3, Mistral's window) keep every position, not about their "
        "window: more memory, more prefix-cache hits on long shared prompts (llama.cpp's --swa-full)",
    )
    limits = GrammarLimits()
    g.add_argument(
        "--grammar-compile-seconds",
        type=float,
        default=limits.compile_seconds,
        metavar="S",
        help="structured output: a new grammar compiles first in a child process, killed after S "
        "seconds (the request gets a 400 naming the limit; default %(default)g)",
    )
    g.add_argument(
        "--grammar-compile-mib",
        type=int,
        default=limits.compile_mib,
        metavar="MIB",
        help="... and held to MIB of memory (default %(default)d)",
    )
    g.add_argument(
        "--grammar-cache-mib",
        type=int,
        default=limits.cache_mib,
        metavar="MIB",
        help="compiled grammars kept for reuse, least recently used first out (default %(default)d)",
    )
    g.add_argument(
        "--grammar-mask-ms",
        type=float,
        default=limits.mask_ms_per_token,
        metavar="MS",
        help="a request's token masks may take MS a token on average; a request past it ends with an "
        "error naming the limit (default %(default)g)",
    )
    g.add_argument(
        "--grammar-mask-burst-ms",
        type=float,
        default=limits.mask_burst_ms,
        metavar="MS",
        help="... with MS in hand at any time (the first masks build the lexer; default %(default)g)",
    )
    g.add_argument(
        "--grammar-lexer-fuel",
        type=int,
        default=limits.lexer_fuel,
        metavar="N",
        help="llguidance's lexer work for one token mask (its step_lexer_fuel; default %(default)d, "
        "llguidance's own 200000); a grammar past it ends its request with an error",
    )
    template = TemplateLimits()
    g.add_argument(
        "--template-seconds",
        type=float,
        default=template.seconds,
        metavar="S",
        help="the model's chat template renders each chat in a child process, killed after S seconds "
        "(the request gets a 400 naming the limit; default %(default)g)",
    )
    g.add_argument(
        "--template-mib",
        type=int,
        default=template.mib,
        metavar="MIB",
        help="... and held to MIB of memory, its compile too (default %(default)d)",
    )
    g.add_argument(
        "--cuda-graphs",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): on CUDA at TP=1, decode-only iterations replay graphs captured at start-up",
    )
    g.add_argument(
        "--native-forward",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): on CPU (float32/bfloat16, quantized or not; each rank's shard under TP), iterations "
        "run as one native call compiled for this CPU on first use (needs a C compiler)",
    )
    g.add_argument(
        "--native-kernels",
        choices=NATIVE_KERNELS,
        default="auto",
        help="the native step's kernel family: auto (default) = the widest this CPU "
        "runs; another forces it where the CPU can run it (side-by-side runs with llama.cpp built for "
        "the same instruction set). The FLOVER_NATIVE_KERNELS variable overrides auto",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from flover.parallel.launch import rank_device

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=rank_device(args.device),
        quantization=args.quantization,
        max_slots=args.max_slots,
        max_seq_len=args.max_seq_len,
        max_batch_tokens=args.max_batch_tokens,
        prompt_first_iterations=args.prompt_first,
        prompt_first_tokens=args.prompt_first_tokens,
        num_threads=args.threads,
        seed=args.seed,
        speculate=args.speculate,
        speculate_ngram=args.speculate_ngram,
        prefix_cache_mib=args.prefix_cache,
        prefault_prefix_cache=getattr(args, "prefault_prefix_cache", False),
        full_window_kv=args.full_window_kv,
        cuda_graphs=args.cuda_graphs,
        native_forward=args.native_forward,
        native_kernels=args.native_kernels,
        grammar_limits=GrammarLimits(
            compile_seconds=args.grammar_compile_seconds,
            compile_mib=args.grammar_compile_mib,
            cache_mib=args.grammar_cache_mib,
            mask_ms_per_token=args.grammar_mask_ms,
            mask_burst_ms=args.grammar_mask_burst_ms,
            lexer_fuel=args.grammar_lexer_fuel,
        ),
        template_limits=TemplateLimits(seconds=args.template_seconds, mib=args.template_mib),
        stage_timeout=args.stage_timeout,
    )


def _resolve_dtype(args) -> str:
    """`--dtype auto` as the engine resolves it: bfloat16 where the device has it, or where the
    native step's kernels widen it for this model (the checkpoint's architecture decides)."""
    from flover.engine.settings import native_step_may_run
    from flover.hardware import resolve_dtype
    from flover.models import open_checkpoint

    native_forward = getattr(args, "native_forward", "auto")
    native_step = native_forward == "auto"  # (no model named: as the native step would run)
    if getattr(args, "model", None):
        native_step = native_step_may_run(native_forward, open_checkpoint(args.model).model_config())
    return resolve_dtype("auto", getattr(args, "device", "cpu"), native_step)


def _is_follower_rank() -> bool:
    from flover.parallel.launch import launched_rank, launched_ranks

    return launched_ranks() > 1 and launched_rank() != 0


def _ignore_stop_signals() -> None:
    """mpirun forwards SIGTERM/SIGINT/SIGUSR1 to every rank; only world rank 0 decides when to
    stop (it drains, then releases the others), so the other ranks ignore them."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def start_engine(args: argparse.Namespace, serving: bool = False):
    """This process's engine. Under `mpirun -np N` every rank builds its shard of its group's
    engine (`--tp T`: N / T groups; default one group of N); the followers run their leader's
    iterations, the other groups' leaders serve world rank 0's requests, and both return None
    when it shuts down. World rank 0 gets its engine, or with several groups EngineGroups.
    `serving`: structured output's tokenizer view is built now, not on a running server's loop."""
    from flover.engine.engine import Engine
    from flover.engine.groups import EngineGroups, serve_group
    from flover.parallel.groups import Mailbox
    from flover.parallel.launch import launch_groups, launched_rank

    if launched_rank() != 0:  # from the start: rank 0 serves before the others have built their engines
        _ignore_stop_signals()
    launch = launch_groups(args.device, args.tp, args.pp)
    args.comm = launch.world  # a failing rank aborts the whole job
    engine = Engine(engine_config(args), launch.comm, launch.pipe)
    if serving:
        engine.prepare_grammars(checked_elsewhere=launch.layout.index > 0)
    if not engine.is_leader or launch.layout.index > 0:
        _ignore_stop_signals()  # (again, should the launcher not have said this rank's number)
        if engine.is_leader:
            serve_group(engine, Mailbox(launch.world), launch.layout.index)
        else:
            engine.follow()
        return None
    if launch.layout.count > 1:
        log.info(
            "data parallel: %d groups of %d rank(s), leaders at world ranks %s",
            launch.layout.count,
            engine.comm.size if engine.comm else 1,
            list(launch.layout.leaders),
        )
        return EngineGroups(engine, Mailbox(launch.world), launch.layout, launch.world)
    return engine


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("sampling (defaults: greedy, 16 tokens)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="repeatable")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def add_connect_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("daemon client")
    g.add_argument("--connect", metavar="ADDR", help="use a running `flover serve` (e.g. tcp://127.0.0.1:5555)")
    g.add_argument("--curve-server-key", help="the server's public certificate (CURVE)")
    g.add_argument("--curve-client-cert", help="this client's secret certificate (CURVE)")
    g.add_argument("--timeout", type=float, default=None, help="seconds to wait for the server")


def connect(args: argparse.Namespace):
    from flover.client import Client

    server_key = None
    if args.curve_server_key:
        import zmq.auth

        server_key, _ = zmq.auth.load_certificate(args.curve_server_key)
    return Client(
        args.connect, timeout=args.timeout, curve_server_key=server_key, curve_client_cert=args.curve_client_cert
    )


def require_model(args: argparse.Namespace) -> None:
    if not args.connect and not args.model:
        raise ValueError("give --model DIR (in-process engine) or --connect ADDR (a running daemon)")


def cmd_generate_remote(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    params = asdict(sampling_params(args))
    with connect(args) as client:
        for prompt in args.prompts:
            if args.stream:
                for event in client.stream(prompt, **params):
                    if event["event"] == "token":
                        print(event["text"] or "", end="", flush=True)
                    else:
                        print(
                            f"\n[{event['finish_reason']}, {event['usage']['completion_tokens']} tokens, "
                            f"ttft {1000 * event['timings']['ttft_s']:.0f} ms]",
                            file=sys.stderr,
                        )
            else:
                event = client.generate(prompt, **params)
                if args.json:
                    print(json.dumps({"prompt": prompt, **event}))
                else:
                    print(
                        f"{prompt!r} -> {event['text']!r} [{event['finish_reason']}, {len(event['token_ids'])} tokens]"
                    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from flover.engine.engine import LLM

    require_model(args)
    if args.connect:
        return cmd_generate_remote(args)
    params = sampling_params(args)
    engine = start_engine(args)
    if engine is None:
        return 0
    llm = LLM.from_engine(engine)
    start = time.perf_counter()
    try:
        outputs = llm.generate(args.prompts, params)
    finally:
        engine.shutdown()
    wall = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        "usage": out.usage,
                        "logprobs": out.logprobs,
                        "timings": out.timings,
                    }
                )
            )
        else:
            print(f"{prompt!r} -> {out.text!r} [{out.finish_reason}, {len(out.token_ids)} tokens]")
    tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} prompts, {tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s, "
        f"{engine.iterations} iterations)",
        file=sys.stderr,
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from flover.apps.batch import BatchRunner, RemoteBatchRunner, arrival_offsets
    from flover.apps.prompt_file import check_unique_ids, detect_format, iter_records
    from flover.apps.results_file import file_sha256, open_results
    from flover.client import FloverError

    require_model(args)
    if _is_follower_rank():  # only the leader touches the files; the others serve its iterations
        start_engine(args)
        return 0
    if args.arrival == "poisson" and not args.rate:
        raise ValueError("--arrival poisson needs --rate (requests per second)")
    if args.arrival == "interval" and args.interval is None:
        raise ValueError("--arrival interval needs --interval MS")
    if args.prompts == "-":
        data = sys.stdin.buffer.read()
        first = next((x for x in data.split(b"\n") if x.strip()), b"").decode("utf-8", "replace")
        fmt = args.format if args.format != "auto" else detect_format("-", first)
        read = lambda: iter_records(io.BytesIO(data), fmt)  # noqa: E731
        digest = hashlib.sha256(data).hexdigest()
    else:
        fmt = args.format if args.format != "auto" else detect_format(args.prompts)

        def read():
            with open(args.prompts, "rb") as f:  # split on b"\n" only, decoded line by line
                yield from iter_records(f, fmt)

        digest = file_sha256(args.prompts)
    ids = check_unique_ids(read())  # before any work: duplicate ids are an error
    params = sampling_params(args)
    parts = {"prompts_sha256": digest, "params": asdict(params), "token_ids": args.token_ids}
    offsets = arrival_offsets(args.arrival, args.rate, args.interval, args.seed)
    if args.connect:
        with connect(args) as client:
            try:
                health = client.health(timeout=args.timeout or 10.0)
            except (TimeoutError, FloverError) as e:
                raise OSError(f"no flover server answers at {args.connect} ({e})") from None
            client.max_message_bytes = health.get("max_message_bytes", client.max_message_bytes)
            out, done = open_results(args.out, {**parts, "model": health.get("model")})
            try:
                summary = _run_records(
                    args,
                    read,
                    ids,
                    done,
                    offsets,
                    lambda progress: RemoteBatchRunner(
                        client,
                        out,
                        params,
                        ordered=args.ordered,
                        token_ids=args.token_ids,
                        max_in_flight=args.max_in_flight,
                        progress=progress,
                        timeout=args.timeout,
                    ),
                )
            finally:
                out.close()
    else:
        out, done = open_results(args.out, {**parts, "model": str(Path(args.model).resolve()), "dtype": args.dtype})
        engine = None
        try:
            engine = start_engine(args)
            summary = _run_records(
                args,
                read,
                ids,
                done,
                offsets,
                lambda progress: BatchRunner(
                    engine, out, params, ordered=args.ordered, token_ids=args.token_ids, progress=progress
                ),
            )
        finally:
            out.close()
            if engine is not None:
                engine.shutdown()
    print(f"flover run: {summary.line()}", file=sys.stderr)
    incomplete = summary.incomplete_line()
    if incomplete:
        print(f"flover run: {incomplete}", file=sys.stderr)
        return 3
    return 0


def _run_records(args, read, ids: set[str], done: set[str], offsets, make_runner):
    from flover.apps.batch import Progress

    done = done & ids
    todo = (record for record in read() if record.id not in done)
    progress = Progress(len(ids) - len(done), enabled=not args.quiet, interval=args.log_interval)
    summary = make_runner(progress).run(todo, offsets)
    summary.prompts, summary.skipped = len(ids), len(done)
    return summary


def cmd_serve(args: argparse.Namespace) -> int:
    from flover.server.daemon import Daemon, ServeConfig

    engine = start_engine(args, serving=True)
    if engine is None:  # a follower rank: it ran the leader's iterations until shutdown
        return 0
    front_curve = None  # with CURVE, the HTTP front gets a key pair of its own, made here and allowed
    if args.http and args.curve_secret_key:
        import zmq
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(args.curve_secret_key)
        front_curve = (server_public, *zmq.curve_keypair())
    config = ServeConfig(
        bind=args.bind,
        max_waiting=args.max_waiting,
        max_message_bytes=args.max_message_bytes,
        max_client_backlog_bytes=args.max_client_backlog,
        drain_timeout=args.drain_timeout,
        stats_interval=args.stats_interval,
        keepalive_interval=args.keepalive_interval,
        curve_secret_key=args.curve_secret_key,
        curve_allowed_clients=args.curve_allowed_clients,
        curve_extra_clients=(front_curve[1],) if front_curve else (),
    )
    http = None
    try:
        daemon = Daemon(engine, config, model_name=args.model)
        if args.http:
            from flover.server.http_front import HttpLimits, start_http_front

            http = start_http_front(
                args.bind,
                args.http,
                args.model,
                args.api_key or os.environ.get("FLOVER_API_KEY"),
                curve=front_curve,
                max_body_bytes=args.max_message_bytes,
                reasoning_format=args.reasoning_format,
                limits=HttpLimits(
                    args.http_header_timeout,
                    args.http_body_timeout,
                    args.http_keep_alive,
                    args.http_max_connections,
                    args.http_engine_timeout,
                ),
            )
    except BaseException:
        engine.shutdown()
        raise
    try:
        return daemon.serve_forever()
    finally:
        if http is not None:
            from flover.server.http_front import stop_http_front

            stop_http_front(http)


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(args.dir, args.name)
    print(f"wrote {public} (give to the other side) and {secret} (keep private)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from flover.bench.modes import MODES, ModeSettings
    from flover.bench.runner import run_benchmark
    from flover.bench.suite import run_suite
    from flover.bench.workload import Workload, parse_range

    if args.endpoint:
        return _bench_endpoint(args)
    if not args.model:
        raise ValueError("give --model (the local modes) or --endpoint URL (an OpenAI-compatible server)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    settings = ModeSettings(
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        max_slots=args.max_slots,
        max_seq_len=args.max_seq_len,
        window_ms=args.window_ms,
        window_batch=args.window_batch,
        instances=args.instances,
    )
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if args.suite == "paper":
        docs = None if args.quick else args.docs
        text = run_suite(args.model, args.out, docs, settings, quick=args.quick, modes=modes, log=say)
        print(text)
        return 0
    if args.quick:
        workload = Workload(4, (4, 12), (4, 8), "interval", 30, args.bench_seed)
    else:
        workload = Workload(
            args.requests,
            parse_range(args.prompt_len),
            parse_range(args.gen_len),
            args.arrival,
            args.interval_ms,
            args.bench_seed,
        )
    result = run_benchmark(args.model, workload, modes, settings, args.out, args.name, log=say)
    print(Path(result["files"]["json"]).with_suffix(".md").read_text())
    return 0


def _bench_endpoint(args: argparse.Namespace) -> int:
    """The workload against any OpenAI-compatible server; --model names the served model (default:
    the first it lists), or is a local checkpoint whose vocabulary sizes the random prompts."""
    from flover.bench.runner import run_endpoint_benchmark
    from flover.bench.workload import Workload, parse_range

    vocab, served = args.vocab_size, args.model
    if args.model and Path(args.model).exists():
        from flover.models import load_model_config

        vocab, served = vocab or load_model_config(args.model).vocab_size, None
    workload = Workload(
        args.requests,
        parse_range(args.prompt_len),
        parse_range(args.gen_len),
        args.arrival,
        args.interval_ms,
        args.bench_seed,
    )
    if args.quick:
        workload = Workload(4, (4, 12), (4, 8), "interval", 30, args.bench_seed)
    result = run_endpoint_benchmark(
        args.endpoint,
        served,
        workload,
        vocab or 32000,
        args.out,
        args.name,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    print(Path(result["files"]["json"]).with_suffix(".md").read_text())
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from flover.apps.chat import LocalReplies, RemoteReplies, chat_loop

    require_model(args)
    params = sampling_params(args)
    if args.connect:
        with connect(args) as client:
            return chat_loop(RemoteReplies(client, params), args.system)
    engine = start_engine(args)
    if engine is None:  # a follower rank
        return 0
    try:
        return chat_loop(LocalReplies(engine, params), args.system)
    finally:
        engine.shutdown()


def cmd_demo(args: argparse.Namespace) -> int:
    from flover.apps.demo import run_demo

    run_demo(
        args.model,
        args.preset,
        args.models_dir,
        args.rate,
        args.max_new_tokens,
        args.max_slots,
        args.dtype,
        args.threads,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flover", description="temporal-fusion LLM inference")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    add_generate_command(sub)
    add_run_command(sub)
    add_serve_command(sub)
    add_chat_command(sub)
    add_keygen_command(sub)
    add_bench_command(sub)
    add_demo_command(sub)
    return ap


def add_generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="generate from prompts given on the command line")
    add_engine_args(gen, model_required=False)
    add_sampling_args(gen)
    add_connect_args(gen)
    gen.add_argument("--stream", action="store_true", help="print tokens as they come (with --connect)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("prompts", nargs="+")
    gen.set_defaults(func=cmd_generate)


def add_run_command(sub) -> None:
    run = sub.add_parser(
        "run",
        help="run every prompt of a file; resumable JSONL output",
        description="Run a prompt file through the engine. Re-running the same command "
        "resumes: ids already in --out are skipped.",
    )
    add_engine_args(run, model_required=False)
    add_sampling_args(run)
    add_connect_args(run)
    run.add_argument("--max-in-flight", type=int, default=64, help="with --connect: outstanding requests")
    run.add_argument("--prompts", required=True, help=".txt (one prompt a line), .jsonl, or - for stdin")
    run.add_argument("--format", choices=("auto", "txt", "jsonl"), default="auto")
    run.add_argument("--out", required=True, help="JSONL results file (appended; - for stdout)")
    run.add_argument("--ordered", action="store_true", help="write results in input order")
    run.add_argument("--token-ids", action="store_true", help="include token ids in each record")
    run.add_argument(
        "--arrival",
        choices=("none", "poisson", "interval"),
        default="none",
        help="make prompts arrive over time (experiments)",
    )
    run.add_argument("--rate", type=float, help="poisson arrivals per second")
    run.add_argument("--interval", type=float, help="ms between arrivals")
    run.add_argument("--quiet", action="store_true", help="no progress output")
    run.add_argument("--log-interval", type=float, default=10.0, help="seconds between progress lines (no TTY)")
    run.set_defaults(func=cmd_run)


def add_serve_command(sub) -> None:
    serve = sub.add_parser("serve", help="the daemon: a ZeroMQ socket in front of the engine")
    add_engine_args(serve)
    d = serve.add_argument_group("daemon")
    d.add_argument("--bind", default="tcp://127.0.0.1:5555", help="tcp://HOST:PORT or ipc://PATH (loopback default)")
    d.add_argument("--max-waiting", type=int, default=256, help="queued requests before `overloaded`")
    d.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        help="largest message, all frames together (a larger single frame drops the connection)",
    )
    d.add_argument(
        "--max-client-backlog",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="unread events kept for one client; beyond, its requests are cancelled (slow_client)",
    )
    d.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish work on SIGTERM")
    d.add_argument("--stats-interval", type=float, default=60.0, help="seconds between summary log lines")
    d.add_argument(
        "--keepalive-interval",
        type=float,
        default=1.0,
        help="seconds between keepalive events to clients with requests in flight "
        "(how fast a vanished client's work is cancelled)",
    )
    d.add_argument("--curve-secret-key", help="server secret certificate: enables CURVE encryption + auth")
    d.add_argument("--curve-allowed-clients", help="directory of allowed client public certificates")
    from flover.server.http_front import HttpLimits

    HTTP_LIMITS = HttpLimits()
    h = serve.add_argument_group("OpenAI-compatible HTTP API (its own process, a client of the socket)")
    h.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=None,
        help="also serve the OpenAI HTTP API, e.g. 127.0.0.1:8000 (loopback unless you say otherwise)",
    )
    h.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every HTTP endpoint but /health (or set FLOVER_API_KEY)",
    )
    h.add_argument(
        "--http-header-timeout",
        type=float,
        default=HTTP_LIMITS.header_timeout,
        metavar="SECONDS",
        help="a request's headers must arrive within this (from the connection or its previous answer)",
    )
    h.add_argument(
        "--http-body-timeout",
        type=float,
        default=HTTP_LIMITS.body_timeout,
        metavar="SECONDS",
        help="a request's body must arrive within this after its headers",
    )
    h.add_argument(
        "--http-keep-alive",
        type=float,
        default=HTTP_LIMITS.keep_alive_timeout,
        metavar="SECONDS",
        help="an idle connection between requests is closed after this",
    )
    h.add_argument(
        "--http-max-connections",
        type=int,
        default=HTTP_LIMITS.max_connections,
        help="open HTTP connections at once; more are closed as they arrive",
    )
    h.add_argument(
        "--http-engine-timeout",
        type=float,
        default=HTTP_LIMITS.engine_timeout,
        metavar="SECONDS",
        help="a request whose daemon sends nothing (no token, no keepalive) for this long ends with an "
        "engine_unresponsive error (a frozen daemon or pipeline stage); /health says 503 meanwhile",
    )
    h.add_argument(
        "--reasoning-format",
        choices=("auto", "none"),
        default="auto",
        help="auto: a chat answer's opening <think>...</think> block (Qwen3, SmolLM3), or gpt-oss's analysis "
        "channel (harmony), comes back as reasoning_content, apart from content, where the model's chat template "
        "knows them; none: left in content (harmony's markers too)",
    )
    d.add_argument(
        "--prefault-prefix-cache",
        action="store_true",
        help="take the prefix cache's memory at start-up instead of as it fills (its first stores "
        "then cost no page faults inside iterations: ~1.5%% of a fresh daemon's time)",
    )
    serve.set_defaults(func=cmd_serve)


def add_chat_command(sub) -> None:
    chat = sub.add_parser("chat", help="an interactive chat in the terminal (the checkpoint's chat template)")
    add_engine_args(chat, model_required=False)
    add_sampling_args(chat)
    add_connect_args(chat)
    chat.add_argument("--system", default=None, help="a system message that starts every conversation")
    chat.set_defaults(func=cmd_chat, max_new_tokens=512)


def add_keygen_command(sub) -> None:
    keygen = sub.add_parser("keygen", help="make a CURVE key pair (zmq.auth certificate files)")
    keygen.add_argument("dir")
    keygen.add_argument("--name", default="server", help="file name stem: NAME.key and NAME.key_secret")
    keygen.set_defaults(func=cmd_keygen)


def add_bench_command(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="the same seeded workload through fused / serial / window / instances / hf, "
        "or against any OpenAI-compatible server (--endpoint)",
    )
    add_engine_args(bench, model_required=False)
    w = bench.add_argument_group("workload (seeded)")
    w.add_argument("--requests", type=int, default=32)
    w.add_argument("--prompt-len", default="64", help="N or A,B for U(A, B)")
    w.add_argument("--gen-len", default="128", help="N or A,B for U(A, B); EOS is ignored")
    w.add_argument("--arrival", choices=("all", "interval", "poisson"), default="poisson")
    w.add_argument("--interval-ms", type=float, default=100.0, help="interval, or the Poisson mean interval")
    w.add_argument("--bench-seed", type=int, default=0)
    m = bench.add_argument_group("modes")
    m.add_argument("--modes", default="fused,serial,window,instances,hf")
    m.add_argument("--window-ms", type=float, default=500.0, help="window / hf: longest wait for a batch")
    m.add_argument("--window-batch", type=int, default=32, help="window / hf: largest batch")
    m.add_argument("--instances", type=int, default=2, help="instances: model processes")
    e = bench.add_argument_group("any OpenAI-compatible server instead of local modes")
    e.add_argument(
        "--endpoint",
        metavar="URL",
        help="e.g. http://127.0.0.1:8000 (flover serve --http, llama-server, "
        "vLLM); --model then names the served model (default: the first "
        "it lists) or a local checkpoint for the vocabulary size",
    )
    e.add_argument("--api-key", default=None, help="Bearer token for --endpoint (default: $OPENAI_API_KEY)")
    e.add_argument("--vocab-size", type=int, default=None, help="--endpoint: random prompt ids below this (32000)")
    bench.add_argument("--out", default="results", help="directory for JSON, Markdown and PNG files")
    bench.add_argument("--name", default="bench", help="file name stem of this run's results")
    bench.add_argument("--quick", action="store_true", help="a tiny workload: a smoke test of the harness")
    bench.add_argument("--suite", choices=("paper",), help="the Flover talk's experiments 1, 2, 3, 4, 6")
    bench.add_argument("--docs", default="docs/benchmarks.md", help="--suite: the page to write the results into")
    bench.set_defaults(func=cmd_bench)


def add_demo_command(sub) -> None:
    demo = sub.add_parser("demo", help="see temporal fusion at work (makes a small random model if needed)")
    demo.add_argument(
        "--model",
        default=None,
        help="a GGUF file, checkpoint directory or hub id (default: "
        "SmolLM2-135M-Instruct, fetched once into --models-dir)",
    )
    demo.add_argument("--preset", default=None, help="a random demo model instead: bench-124m or tiny (quicker)")
    demo.add_argument("--models-dir", default="models", help="where the demo model is made")
    demo.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--max-slots", type=int, default=32)
    demo.add_argument("--dtype", choices=DTYPES, default="auto")
    demo.add_argument("--threads", type=int, default=None)
    demo.set_defaults(func=cmd_demo)


# How long an idle OpenMP worker spins before it sleeps (libgomp, which PyTorch and the native
# step share; read once, when torch loads it). The default, 300,000 rounds, is milliseconds: the
# worker spins through the Python between two iterations (replies, detokenizing), when the
# clients and ZeroMQ's I/O threads want a core, and they take one from the next forward instead.
# 10,000 is a fraction of a millisecond, far more than the gaps inside a forward (figures:
# docs/design_notes.md, "OpenMP spin count"). An OMP_WAIT_POLICY or GOMP_SPINCOUNT of the caller wins.
OPENMP_SPIN_COUNT = "10000"


def main(argv: list[str] | None = None) -> int:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    from flover.parallel.launch import launched_rank, launched_ranks

    args = build_parser().parse_args(argv)
    args.comm = None
    ranks = launched_ranks()
    if ranks > 1 and args.command == "demo":
        print("flover: error: flover demo runs in one process; use flover run/generate under mpirun", file=sys.stderr)
        return 2
    prefix = f"flover[rank {launched_rank()}]" if ranks > 1 else "flover"
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format=f"{prefix}: %(message)s", stream=sys.stderr
    )
    try:
        _resolve_hub_id(args)
        if getattr(args, "dtype", None) == "auto":  # concrete from here on: logs, results files, bench tables
            args.dtype = _resolve_dtype(args)
        return args.func(args)
    except (
        ValueError,
        MemoryError,
        OSError,
        RuntimeError,
    ) as e:  # CheckpointError is a ValueError, FetchError a RuntimeError
        print(f"{prefix}: error: {e or type(e).__name__}", file=sys.stderr, flush=True)
        code = 2
    except BaseException as e:  # anything else: say which rank failed and why
        if ranks <= 1:
            raise
        import traceback

        print(f"{prefix}: failed: {e!r}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    if ranks > 1:
        _abort_job(args.comm, code)  # one failing rank ends the whole job, never a hang
    return code


def _resolve_hub_id(args: argparse.Namespace) -> None:
    from flover.apps.fetch import is_hub_id, resolve_hub_id

    model = getattr(args, "model", None)
    if model and is_hub_id(model):
        args.model = resolve_hub_id(model)


def _abort_job(comm, code: int) -> None:
    if comm is None:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    comm.abort(code)


if __name__ == "__main__":
    sys.exit(main())
