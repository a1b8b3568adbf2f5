"""The flags several commands share: the engine's (generated from EngineConfig's fields,
flover/flags.py), sampling, and a daemon client's."""

from __future__ import annotations

import argparse

from flover.config import EngineConfig, SamplingParams
from flover.flags import add_flags, from_flags

SERVE_ONLY = ("prefault_prefix_cache",)  # engine fields only `flover serve` offers (apps/serve.py)


def add_engine_args(ap: argparse.ArgumentParser, model_required: bool = True, skip: tuple[str, ...] = SERVE_ONLY):
    g = ap.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=model_required,
        help="a GGUF file, a Hugging Face checkpoint directory, or a hub id ORG/NAME (from the local "
        "hub cache, downloaded where a hub is reachable)",
    )
    add_flags(g, EngineConfig, skip=skip)
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
    return g


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the flags (this rank's device: cuda:N under mpirun)."""
    from flover.parallel.launch import rank_device

    return from_flags(EngineConfig, args, model=args.model, device=rank_device(args.device))


def start_engine(args: argparse.Namespace, serving: bool = False):
    """engine/launch.start_engine from the flags; the world communicator lands in args.comm."""
    from flover.engine.launch import start_engine as start

    return start(
        lambda: engine_config(args),
        args.device,
        args.tp,
        args.pp,
        serving=serving,
        on_world=lambda comm: setattr(args, "comm", comm),
    )


def resolve_dtype(args: argparse.Namespace) -> str:
    """`--dtype auto` as the engine resolves it: bfloat16 where the device has it, or where the
    native step's kernels widen it for this model (the checkpoint's family decides)."""
    from flover.engine.settings import bfloat16_by_default
    from flover.hardware import resolve_dtype as resolve
    from flover.models import file_quantization, open_checkpoint

    native_forward = getattr(args, "native_forward", "auto")
    native_step = native_forward == "auto"  # (no model named: as the native step would run)
    if getattr(args, "model", None):
        checkpoint = open_checkpoint(args.model)
        native_step = bfloat16_by_default(native_forward, checkpoint.model_config(), file_quantization(checkpoint))
    return resolve("auto", getattr(args, "device", "cpu"), native_step)


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
