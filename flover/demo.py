"""`flover demo`: temporal fusion at work on a bundled prompt file.

1. Makes the demo model if it is missing (random weights: the text is meaningless).
2. Runs the prompts with Poisson arrivals through the fused engine, showing per iteration how
   many requests have arrived, are in flight, and have finished.
3. Runs the same prompts with the same arrivals one at a time (request-level scheduling: the
   same engine limited to one slot), and prints both side by side.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from flover.batch import BatchRunner, BatchSummary, arrival_offsets
from flover.config import EngineConfig, SamplingParams
from flover.engine import Engine
from flover.prompt_file import iter_records
from flover.results_file import ResultsFile

DEMO_PROMPTS = Path(__file__).resolve().parent / "data" / "demo_prompts.txt"


def ensure_model(model: str | None, preset: str, models_dir: str, say) -> str:
    if model is not None:
        return model
    path = Path(models_dir) / preset
    if (path / "config.json").is_file():
        say(f"using {path} (random weights: its text is meaningless)")
        return str(path)
    from flover.tiny_model import make_tiny_model

    say(f"making the demo model {path} (preset {preset}) ...")
    make_tiny_model("llama", preset, path)
    say(f"made {path}. Its weights are RANDOM, so the generated text is meaningless; the speed is real.")
    return str(path)


class LiveView:
    """One line per iteration in which a request joined or left (in place on a terminal)."""

    def __init__(self, total: int, slots: int, stream=sys.stdout):
        self.total, self.slots, self.stream = total, slots, stream
        self.tty = stream.isatty()
        self._last = None

    def __call__(self, runner: BatchRunner, outputs) -> None:
        sched = runner.engine.scheduler
        running, waiting = sched.num_live, len(sched.waiting)
        finished = runner.summary.completed + runner.summary.errors
        state = (runner.arrived, finished)
        if state == self._last and not self.tty:
            return
        self._last = state
        width = min(self.slots, 32)
        filled = round(width * running / self.slots)
        bar = "█" * filled + "·" * (width - filled)
        line = (f"iter {runner.summary.iterations:5d} | arrived {runner.arrived:3d}/{self.total} | "
                f"in flight {running:3d} ▕{bar}▏ waiting {waiting:3d} | finished {finished:3d}")
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        else:
            print(line, file=self.stream)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def run_once(config: EngineConfig, prompts: Path, params: SamplingParams, rate: float, seed: int,
             view=None) -> tuple[BatchSummary, list[dict]]:
    engine = Engine(config)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = f"{tmp}/out.jsonl"
        out = ResultsFile(out_path)
        runner = BatchRunner(engine, out, params, on_step=view)
        with open(prompts, encoding="utf-8") as f:
            records = list(iter_records(f, "txt"))
        summary = runner.run(records, arrival_offsets("poisson", rate=rate, seed=seed))
        out.close()
        with open(out_path, encoding="utf-8") as f:
            results = [json.loads(line) for line in f]
    summary.prompts = len(records)
    return summary, results


def run_demo(model: str | None, preset: str, models_dir: str, rate: float, max_new_tokens: int,
             max_slots: int, dtype: str, threads: int | None, seed: int = 0, stream=sys.stdout) -> dict:
    say = lambda text: print(text, file=stream, flush=True)  # noqa: E731
    model_dir = ensure_model(model, preset, models_dir, say)
    if model is None:
        say("  (for real text: flover demo --model /path/to/a/hf-checkpoint, e.g. a Llama, Mistral, Qwen2 "
            "or GPT-J directory with config.json, *.safetensors and tokenizer.json)")
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    prompts = DEMO_PROMPTS
    n = sum(1 for line in prompts.read_text().splitlines() if line.strip())
    say(f"\n{n} prompts arriving at random (Poisson, {rate:g} per second), {max_new_tokens} tokens each.")
    say("\n== temporal fusion: every arrival joins the running batch at the next iteration ==")
    view = LiveView(n, max_slots, stream)
    config = EngineConfig(model_dir, dtype=dtype, max_slots=max_slots, num_threads=threads)
    fused, fused_results = run_once(config, prompts, params, rate, seed, view)
    view.close()
    say("\n== the same prompts and arrivals, one request at a time ==")
    serial_config = EngineConfig(model_dir, dtype=dtype, max_slots=1, num_threads=threads)
    serial, serial_results = run_once(serial_config, prompts, params, rate, seed)
    say(f"done in {serial.wall_s:.1f} s, {serial.iterations} iterations")

    rows = [("makespan (s)", fused.wall_s, serial.wall_s, "{:.2f}"),
            ("output tokens/s", fused.tokens_per_s, serial.tokens_per_s, "{:.0f}"),
            ("latency p50 (s)", *_pct(fused_results, serial_results, "e2e_s", 50), "{:.2f}"),
            ("latency p90 (s)", *_pct(fused_results, serial_results, "e2e_s", 90), "{:.2f}"),
            ("time to first token p50 (s)", *_pct(fused_results, serial_results, "ttft_s", 50), "{:.3f}"),
            ("iterations", fused.iterations, serial.iterations, "{:.0f}")]
    say(f"\n{'':30s}{'fused':>12s}{'one at a time':>16s}")
    for name, a, b, fmt in rows:
        say(f"{name:30s}{fmt.format(a):>12s}{fmt.format(b):>16s}")
    say(f"\ntemporal fusion finished the same work {serial.wall_s / fused.wall_s:.1f}x sooner.")
    return {"fused": fused, "serial": serial}


def _pct(a: list[dict], b: list[dict], key: str, q: int) -> tuple[float, float]:
    def pct(results):
        values = sorted(r["latency"][key] for r in results)
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]
    return pct(a), pct(b)
