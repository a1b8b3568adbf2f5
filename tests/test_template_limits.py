"""A model's chat template is input (flover/chat_template.py): compiled and rendered in a bounded
child, so that a template that loops or builds gigabytes costs a chat a 400 naming the limit, never
the server its answers, its memory or its shutdown; malformed template fields turn chat off."""

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
from flover.client import FloverError
from flover.request import RequestInput
from tests.helpers import Server, read_records, write_jsonl

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = (  # by the first message's content: 10^10 iterations, or 10^8 copies of it
    "{% if messages[0].content == 'loop' %}" + LOOP + "{% endif %}"
    "{% if messages[0].content.startswith('big') %}{{ messages[0].content * 100000000 }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
)
FOLDED = "{{ 'a' * 10**9 }}{% for m in messages %}{{ m.content }}{% endfor %}"  # a gigabyte at compile


def with_template(src: str, dst: Path, template) -> str:
    """A copy of checkpoint `src` whose tokenizer_config.json says chat_template: `template`."""
    model = Path(shutil.copytree(src, dst))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return str(model)


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_a_looping_or_swelling_template_costs_its_chat_a_400_not_the_server(llama_dir, tmp_path):
    model = with_template(llama_dir, tmp_path / "m", HOSTILE)
    srv = Server(model, "--max-slots", "4", "--template-seconds", "3", "--drain-timeout", "30")
    try:
        with srv.client() as c:
            assert c.generate(messages=chat("hi"), max_new_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3
            before = resident_mib(srv.proc.pid)
            c.send({"op": "generate", "id": "loop", "messages": chat("loop"), "params": {"max_new_tokens": 3}})
            text = c.generate("Hello the cat", max_new_tokens=4, ignore_eos=True)  # no template: not behind it
            with pytest.raises(FloverError) as looped:
                c.wait("loop")
            assert looped.value.code == "invalid_request" and "--template-seconds" in str(looped.value)
            assert text["usage"]["completion_tokens"] == 4
            with pytest.raises(FloverError) as swelled:
                c.generate(messages=chat("big" * 10), max_new_tokens=3)
            assert swelled.value.code == "invalid_request" and "--template-mib" in str(swelled.value)
            assert resident_mib(srv.proc.pid) < before + 64  # the server's own memory did not move
            again = c.generate(messages=chat("hi"), max_new_tokens=3, ignore_eos=True)  # a fresh child
            assert again["usage"]["completion_tokens"] == 3
            assert c.health()["status"] == "ok"
            c.send({"op": "generate", "id": "late", "messages": chat("loop"), "params": {"max_new_tokens": 3}})
            time.sleep(0.5)  # rendering now
            srv.proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            srv.proc.wait(timeout=30)
            assert time.monotonic() - stopped < 10  # SIGTERM still stops it: the render is killed with it
    finally:
        code, err = srv.stop()
    assert code == 0 and "Traceback" not in err, err[-3000:]


def test_a_template_that_folds_a_gigabyte_at_compile_costs_flover_run_nothing(llama_dir, tmp_path):
    """`flover run`: the chat line is an error record naming the limit, the text line runs; the
    process tree never holds the gigabyte (its largest process's peak, measured by a parent)."""
    model = with_template(llama_dir, tmp_path / "m", FOLDED)
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, [{"id": "chat", "messages": chat("hi")}, {"id": "text", "prompt": "Hello the cat"}])
    measure = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)"
    )
    cmd = [sys.executable, "-m", "flover.apps.cli", "run", "--model", model, "--prompts", str(prompts)]
    run = subprocess.run(
        [sys.executable, "-c", measure, *cmd, "--out", str(out), "--max-seq-len", "128", "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    peak_kib, code = map(int, run.stdout.split()[-2:])
    by_id = {r["id"]: r for r in read_records(out)}
    assert "(--template-mib)" in by_id["chat"]["error"]["message"], by_id
    assert "error" not in by_id["text"] and by_id["text"]["usage"]["completion_tokens"] >= 1
    assert peak_kib < 1000 * 1024, peak_kib  # the engine (~0.5 GB) or the capped child; never the 1 GB string
    assert code == 0 and "1 completed, 1 errors" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    "template, named",
    [
        ([1], "chat_template must be a string or a list of {name, template}"),
        ([{"name": "default"}], None),  # no default template: chat is off, as without one
        (5, "chat_template must be a string, not int"),
        ([{"name": "default", "template": 7}], "chat_template 'default' template must be a string, not int"),
        ({"default": "x"}, "chat_template must be a string, not dict"),
    ],
)
def test_malformed_chat_template_fields_turn_chat_off_naming_the_file(llama_dir, tmp_path, template, named, caplog):
    model = with_template(llama_dir, tmp_path / "m", template)
    llm = LLM(model, dtype="float64", max_seq_len=64, max_slots=2)
    if named is not None:
        assert f"{model}/tokenizer_config.json: {named}" in caplog.text and "chat is off" in caplog.text
    with pytest.raises(ValueError, match="chat template"):
        llm.engine.make_request(RequestInput(None, messages=chat("hi")))
    assert len(llm.generate(["Hello"], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_a_malformed_chat_template_field_is_one_line_on_the_command_line(llama_dir, tmp_path):
    model = with_template(llama_dir, tmp_path / "m", [1])
    run = subprocess.run(
        [sys.executable, "-m", "flover.apps.cli", "generate", "--model", model, "--max-new-tokens", "2", "Hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert f"{model}/tokenizer_config.json: chat_template must be a string or a list" in run.stderr


def test_a_gguf_chat_template_that_is_not_a_string_turns_chat_off(llama_dir, tmp_path):
    from flover.testing.tiny_model import write_gguf

    model = with_template(llama_dir, tmp_path / "m", 7)  # written as the file's UINT32
    path = write_gguf(model, tmp_path / "m.gguf", "Q8_0")
    llm = LLM(str(path), max_seq_len=64, max_slots=2)
    with pytest.raises(ValueError, match=r"m\.gguf: tokenizer\.chat_template must be a string, not int"):
        llm.engine.make_request(RequestInput(None, messages=chat("hi")))
    assert len(llm.generate(["Hello"], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_prompts_cancelled_in_a_lane_free_their_places_up_to_a_bound(llama_dir, tmp_path):
    """A looping template holds the rendering lane; chats sent and cancelled behind it no longer
    hold places in the queue (--max-waiting 2: before, the second was refused `overloaded` with
    nothing waiting), but the lane keeps at most --max-waiting of them, each with its message."""
    model = with_template(llama_dir, tmp_path / "m", HOSTILE)
    srv = Server(model, "--max-slots", "1", "--max-waiting", "2", "--template-seconds", "3")
    try:
        with srv.client() as c:
            c.send({"op": "generate", "id": "loop", "messages": chat("loop"), "params": {"max_new_tokens": 3}})
            for rid in ("c0", "c1", "c2"):
                c.send({"op": "generate", "id": rid, "messages": chat("hi"), "params": {"max_new_tokens": 3}})
                c.send({"op": "cancel", "id": rid})
            assert c.wait("c0")["finish_reason"] == c.wait("c1")["finish_reason"] == "cancelled"
            with pytest.raises(FloverError) as refused:
                c.wait("c2")
            assert refused.value.code == "overloaded"
            with pytest.raises(FloverError) as looped:
                c.wait("loop")
            assert "--template-seconds" in str(looped.value)
            again = c.generate(messages=chat("hi"), max_new_tokens=3, ignore_eos=True)
            assert again["usage"]["completion_tokens"] == 3
    finally:
        code, err = srv.stop()
    assert code == 0 and "Traceback" not in err, err[-3000:]
