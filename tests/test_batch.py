"""`flover run` over prompt files: exactly-once output across hard kills, bad lines, formats."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import transformers

from flover import LLM, SamplingParams
from flover.apps.batch import arrival_offsets
from flover.apps.results_file import ResultsFileError, recover
from tests.helpers import Server, flover_run, read_records, write_jsonl


def test_sigkill_at_random_moments_then_resume_gives_every_record_once(llama_dir, tmp_path):
    rng = random.Random(7)
    jobs = [
        {
            "id": f"p{i}",
            "input_ids": [rng.randrange(1, 512) for _ in range(rng.randint(1, 20))],
            "max_new_tokens": rng.randint(1, 40),
        }
        for i in range(300)
    ]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, jobs)
    cmd = [
        sys.executable,
        "-m",
        "flover.apps.cli",
        "run",
        "--model",
        llama_dir,
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-seq-len",
        "128",
        "--dtype",
        "float64",
        "--ignore-eos",
        "--token-ids",
        "--max-slots",
        "8",
        "--quiet",
    ]
    kills = 0
    for _ in range(6):
        before = len(out.read_bytes().splitlines()) if out.exists() else 0
        target = before + rng.randint(5, 40)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            if out.exists() and len(out.read_bytes().splitlines()) >= target:
                time.sleep(rng.random() * 0.05)  # land anywhere, also inside a write
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.005)
        proc.wait(timeout=60)
        if proc.returncode == 0:
            break
    assert kills >= 4, "the run finished before it could be killed several times"
    final = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr

    records = read_records(out)  # every line is valid JSON
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(j["id"] for j in jobs)  # no loss, no duplicate
    # the records written before the kills are the same as an uninterrupted run's
    llm = LLM(llama_dir, dtype="float64", max_seq_len=128, max_slots=8)
    expected = llm.generate(
        [j["input_ids"] for j in jobs],
        [SamplingParams(max_new_tokens=j["max_new_tokens"], ignore_eos=True) for j in jobs],
    )
    by_id = {r["id"]: r for r in records}
    for job, exp in zip(jobs, expected):
        assert by_id[job["id"]]["token_ids"] == exp.token_ids, job["id"]


def test_torn_last_line_is_dropped_and_damage_elsewhere_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "c", "te')
    assert recover(str(path)) == {"a", "b"}
    assert path.read_bytes() == b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n'
    path.write_bytes(b'{"id": "a"}\n{"id": "b"}')  # complete record, newline lost
    assert recover(str(path)) == {"a", "b"} and path.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    path.write_bytes(b'{"id": "a"}\ngarbage\n{"id": "b"}\n')
    with pytest.raises(ResultsFileError, match="line 2 is not a result record"):
        recover(str(path))


def test_bad_lines_get_error_records_and_the_rest_runs(llama_dir, tmp_path):
    lines = [
        json.dumps({"id": "ok1", "prompt": "Hello the cat", "max_new_tokens": 4}),
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"id": "none"}),
        json.dumps({"id": "typo", "prompt": "x", "max_tokens": 3}),
        json.dumps({"id": "vocab", "input_ids": [1, 99999]}),
        json.dumps({"id": "long", "input_ids": list(range(1, 200))}),
        json.dumps({"id": "temp", "prompt": "x", "temperature": -1}),
        json.dumps({"id": "ok2", "input_ids": [5, 6, 7], "max_new_tokens": 3}),
    ]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    run = flover_run(llama_dir, prompts, out, "--ignore-eos")
    assert run.returncode == 0, run.stderr
    by_id = {r["id"]: r for r in read_records(out)}
    assert by_id["ok1"]["finish_reason"] == "length" and by_id["ok1"]["usage"]["completion_tokens"] == 4
    assert by_id["ok2"]["usage"]["completion_tokens"] == 3
    errors = {rid: (r["error"]["code"], r["line"]) for rid, r in by_id.items() if "error" in r}
    assert errors == {
        "2": ("malformed_line", 2),
        "3": ("malformed_line", 3),
        "none": ("invalid_request", 4),
        "typo": ("invalid_request", 5),
        "vocab": ("invalid_request", 6),
        "long": ("prompt_too_long", 7),
        "temp": ("invalid_request", 8),
    }
    assert "exceeds max_seq_len=128" in by_id["long"]["error"]["message"]
    assert "max_tokens" in by_id["typo"]["error"]["message"]
    assert "7 errors" in run.stderr
    # resuming does not retry them: the file already says what was wrong
    again = flover_run(llama_dir, prompts, out, "--ignore-eos")
    assert again.returncode == 0 and len(read_records(out)) == 9


def test_duplicate_ids_stop_before_any_work(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}])
    run = flover_run(llama_dir, prompts, out)
    assert run.returncode == 2
    assert "duplicate ids in the input: id 'a' on lines 1, 3" in run.stderr
    assert not out.exists()


def test_txt_stdin_and_ordered_output_equal_the_offline_api(llama_dir, tmp_path):
    rng = random.Random(3)
    words = "the cat dog river runs fast slow light dark memory token".split()
    texts = [" ".join(rng.choices(words, k=rng.randint(1, 12))) for _ in range(40)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = LLM(llama_dir, dtype="float64", max_seq_len=128, max_slots=8).generate(texts, params)

    txt, out_txt, out_stdin = tmp_path / "in.txt", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    txt.write_text("\n".join(texts) + "\n")
    common = (
        "--dtype",
        "float64",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--max-slots",
        "8",
        "--token-ids",
        "--ordered",
    )
    run = flover_run(llama_dir, txt, out_txt, *common)
    assert run.returncode == 0, run.stderr
    stdin = flover_run(llama_dir, "-", out_stdin, *common, stdin=txt.read_text())
    assert stdin.returncode == 0, stdin.stderr
    for path in (out_txt, out_stdin):
        records = read_records(path)
        assert [r["id"] for r in records] == [str(i + 1) for i in range(40)]  # input order
        assert [r["token_ids"] for r in records] == [e.token_ids for e in expected]
        assert [r["text"] for r in records] == [e.text for e in expected]


def test_unordered_output_streams_results_as_they_finish(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(
        prompts,
        [
            {"id": "long", "input_ids": [1, 2], "max_new_tokens": 40},
            {"id": "short", "input_ids": [3, 4], "max_new_tokens": 2},
        ],
    )
    assert flover_run(llama_dir, prompts, out, "--ignore-eos").returncode == 0
    assert [r["id"] for r in read_records(out)] == ["short", "long"]
    out.unlink()
    assert flover_run(llama_dir, prompts, out, "--ignore-eos", "--ordered").returncode == 0
    assert [r["id"] for r in read_records(out)] == ["long", "short"]


def test_chat_messages_use_the_checkpoint_template(llama_dir, tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = transformers.AutoTokenizer.from_pretrained(llama_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, [{"id": "chat", "messages": messages}, {"id": "ids", "input_ids": ids}])
    assert flover_run(llama_dir, prompts, out, "--token-ids", "--max-new-tokens", "6").returncode == 0
    by_id = {r["id"]: r for r in read_records(out)}
    assert by_id["chat"]["usage"]["prompt_tokens"] == len(ids)
    assert by_id["chat"]["token_ids"] == by_id["ids"]["token_ids"]


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.mark.parametrize("through", ["engine", "daemon"])
def test_chat_template_kwargs_in_a_prompt_file(llama_dir, tmp_path, through):
    """A line's chat_template_kwargs reach the template (Qwen3's enable_thinking), in-process and
    through a daemon; bad ones, or ones beside a plain prompt, are that line's error record."""
    import shutil

    model = tmp_path / "thinking"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hello there"}]
    ids = transformers.AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, enable_thinking=False
    )["input_ids"]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(
        prompts,
        [
            {"id": "on", "messages": messages},
            {"id": "off", "messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
            {"id": "ids", "input_ids": ids},
            {"id": "reserved", "messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
            {"id": "text", "prompt": "hello", "chat_template_kwargs": {"enable_thinking": False}},
        ],
    )
    if through == "engine":
        assert flover_run(str(model), prompts, out, "--token-ids", "--max-new-tokens", "4").returncode == 0
    else:
        server = Server(str(model), "--max-seq-len", "128")
        try:
            cmd = [sys.executable, "-m", "flover.apps.cli", "run", "--connect", server.addr, "--prompts", str(prompts)]
            run = subprocess.run([*cmd, "--out", str(out), "--token-ids", "--max-new-tokens", "4"], timeout=120)
            assert run.returncode == 0
        finally:
            server.stop()
    by_id = {r["id"]: r for r in read_records(out)}
    assert by_id["off"]["usage"]["prompt_tokens"] == len(ids) > by_id["on"]["usage"]["prompt_tokens"]
    assert by_id["off"]["token_ids"] == by_id["ids"]["token_ids"]
    assert "is set by the server" in by_id["reserved"]["error"]["message"]
    assert "go with `messages`" in by_id["text"]["error"]["message"]


def test_arrival_schedules(llama_dir, tmp_path):
    poisson = arrival_offsets("poisson", rate=50.0, seed=1)
    times = [next(poisson) for _ in range(2001)]
    assert times[0] == 0 and all(b > a for a, b in zip(times, times[1:]))
    assert abs(times[-1] / 2000 - 0.02) < 0.002  # mean gap 1/rate
    interval = arrival_offsets("interval", interval_ms=250)
    assert [next(interval) for _ in range(3)] == [0.0, 0.25, 0.5]

    prompts, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    prompts.write_text("a\nb\nc\nd\n")
    start = time.perf_counter()
    run = flover_run(llama_dir, prompts, out, "--arrival", "interval", "--interval", "400", "--max-new-tokens", "2")
    assert run.returncode == 0, run.stderr
    assert time.perf_counter() - start >= 1.2  # the last prompt arrived 1.2 s after the first
    assert all(r["latency"]["queue_s"] < 0.3 for r in read_records(out))  # no batching window


def test_progress_lines_without_a_terminal(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    prompts.write_text("a\nb\n")
    run = flover_run(llama_dir, prompts, out, "--log-interval", "0", "--max-new-tokens", "3", "--ignore-eos")
    assert run.returncode == 0
    assert "prompts done" in run.stderr
    assert "flover run: 2 prompts: 2 completed, 0 errors, 0 already done" in run.stderr


def test_options_are_checked(llama_dir, tmp_path):
    run = flover_run(llama_dir, tmp_path / "missing.txt", tmp_path / "o.jsonl")
    assert run.returncode == 2 and "missing.txt" in run.stderr
    run = flover_run(llama_dir, tmp_path / "missing.txt", tmp_path / "o.jsonl", "--arrival", "poisson")
    assert run.returncode == 2 and "--rate" in run.stderr
    assert not os.path.exists(tmp_path / "o.jsonl")


def test_demo_makes_its_model_and_compares_fused_with_one_at_a_time(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "flover.apps.cli",
            "demo",
            "--preset",
            "tiny",
            "--models-dir",
            str(tmp_path),
            "--rate",
            "400",
            "--max-new-tokens",
            "12",
            "--max-slots",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "tiny" / "config.json").is_file()
    out = run.stdout
    assert "RANDOM" in out and "--model" in out  # says the text is meaningless, and what to do instead
    assert "arrived  32/32" in out and "finished  32" in out
    fused, serial = out.split("one request at a time")
    assert "finished  32" in serial  # the long phase shows its progress too
    for phase in (fused, serial):  # a request counts once: in flight or finished, never both
        for line in phase.splitlines():
            if line.startswith("iter "):
                fields = line.replace("|", " ").replace("/", " ").split()
                arrived, in_flight = int(fields[fields.index("arrived") + 1]), int(fields[fields.index("flight") + 1])
                waiting, finished = int(fields[fields.index("waiting") + 1]), int(fields[fields.index("finished") + 1])
                assert in_flight + waiting + finished == arrived, line
    table = {
        line.split()[0]: line.split()[-2:] for line in out.splitlines() if line.startswith(("makespan", "iterations"))
    }
    fused_iters, serial_iters = map(float, table["iterations"])
    assert serial_iters == 32 * 12  # one request at a time: one token per iteration
    assert fused_iters < serial_iters  # requests shared iterations
    assert "sooner" in out


def test_records_carry_the_logprobs_a_line_asks_for(llama_dir, tmp_path):
    import torch

    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [5, 17, 250, 3, 99]
    write_jsonl(
        prompts,
        [
            {"id": "scored", "input_ids": ids, "prompt_logprobs": True, "logprobs": True, "top_logprobs": 2},
            {"id": "plain", "input_ids": ids},
        ],
    )
    run = flover_run(
        llama_dir, prompts, out, "--dtype", "float64", "--max-new-tokens", "3", "--ignore-eos", "--token-ids"
    )
    assert run.returncode == 0, run.stderr
    by_id = {r["id"]: r for r in read_records(out)}
    assert not {"logprobs", "prompt_logprobs", "top_logprobs"} & set(by_id["plain"])
    scored = by_id["scored"]
    engine = LLM(llama_dir, dtype="float64", max_seq_len=128).engine
    logp = torch.log_softmax(engine.score(ids + scored["token_ids"]), dim=-1)
    assert scored["prompt_logprobs"][0] is None
    assert scored["prompt_logprobs"][1:] == pytest.approx([float(logp[p - 1, ids[p]]) for p in range(1, 5)], abs=1e-9)
    assert [[t for t, _ in top] for top in scored["prompt_top_logprobs"][1:]] == [
        logp[p - 1].topk(2).indices.tolist() for p in range(1, 5)
    ]
    assert len(scored["logprobs"]) == len(scored["top_logprobs"]) == 3


def test_ordered_output_holds_a_bounded_number_of_records_behind_a_long_first_one(llama_dir, tmp_path):
    """The first prompt asks 100 tokens, 40 more ask 1: at most `max_held` finished records wait
    for it, plus those in flight when that many did (no prompt is admitted beyond), and every record
    is written, in input order."""
    from flover.apps.batch import BatchRunner
    from flover.apps.prompt_file import PromptRecord
    from flover.apps.results_file import ResultsFile

    llm = LLM(llama_dir, dtype="float64", max_seq_len=128, max_slots=4)
    records = [
        PromptRecord(
            index=i, line=i + 1, id=str(i), prompt=[1 + i, 2, 3], sampling={"max_new_tokens": 100 if i == 0 else 1}
        )
        for i in range(41)
    ]
    out = ResultsFile(str(tmp_path / "out.jsonl"))
    held = []
    runner = BatchRunner(
        llm.engine,
        out,
        SamplingParams(ignore_eos=True),
        ordered=True,
        max_held=4,
        on_step=lambda r, _: held.append(r.writer.held),
    )
    runner.run(records)
    out.close()
    assert 4 <= max(held) <= 4 + 4 + 4  # the bound, plus what was in flight (slots, queue) when it was reached
    assert [r["id"] for r in read_records(tmp_path / "out.jsonl")] == [str(i) for i in range(41)]
