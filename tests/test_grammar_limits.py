"""Hardening, third pass: what one structure (or one malformed message) may cost the server.

Real `flover serve` processes and real clients: a schema whose compile explodes is refused with a
400-class error naming the limit while the daemon stays small and an innocent request beside it
finishes; a request whose masks take more than its budget ends with an error naming the limit
and the requests fused with it get their solo tokens; the grammar cache holds bytes, not a
count; numbers cannot run away; every message the daemon cannot take is answered with its id."""

from __future__ import annotations

import json
import os
import time

import llguidance
import msgpack
import pytest
import zmq

from flover import LLM, SamplingParams
from flover.client import FloverError
from flover.structured.grammars import Grammars
from flover.structured.spec import NUMBER_BOUND, GrammarLimits, Structured
from tests.helpers import Server

# 27 string patterns a{1} ... a{27} under allOf: llguidance proves their intersection non-empty
# by a regex construction that grows exponentially (21 of them: 7 s and 0.5 GB here).
BOMB = {"type": "string", "allOf": [{"pattern": "a{%d}" % i} for i in range(1, 28)]}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.fixture
def small_limits_server(llama_dir):
    srv = Server(llama_dir, "--max-slots", "4", "--grammar-compile-seconds", "3", "--grammar-compile-mib", "256")
    yield srv
    srv.stop()


def test_a_schema_whose_compile_explodes_is_refused_naming_the_limit_and_costs_the_daemon_nothing(small_limits_server):
    srv = small_limits_server
    with srv.client() as c:
        before = _rss_mib(srv.proc.pid)
        innocent = c.new_id()
        c.send(
            {
                "op": "generate",
                "id": innocent,
                "stream": False,
                "input_ids": [1, 2, 3],
                "params": {"max_new_tokens": 40, "ignore_eos": True},
            }
        )
        started = time.monotonic()
        with pytest.raises(FloverError) as refused:
            c.generate(
                input_ids=[1, 2], max_new_tokens=8, structured={"kind": "json_schema", "value": json.dumps(BOMB)}
            )
        assert refused.value.code == "invalid_request"
        assert "grammar-compile" in refused.value.message  # names the limit (memory or time)
        assert time.monotonic() - started < 30
        assert c.wait(innocent)["finish_reason"] == "length"
        assert _rss_mib(srv.proc.pid) - before < 200  # the compile's gigabytes were the child's
        # the server goes on compiling what is cheap (a fresh child)
        ok = c.generate(input_ids=[1, 2], max_new_tokens=8, structured={"kind": "choice", "value": ["yes", "no"]})
        assert ok["text"] in ("yes", "no")


def test_a_request_whose_masks_overrun_their_budget_ends_naming_the_limit_and_others_are_untouched(llama_dir):
    limits = GrammarLimits(mask_ms_per_token=0.0, mask_burst_ms=0.0)  # any mask at all is over budget
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64, grammar_limits=limits)
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], plain)[0].token_ids
    costly, fused = llm.generate(
        [[1, 2], [5, 6, 7]], [SamplingParams(max_new_tokens=12, structured=Structured("regex", "[a-z]+")), plain]
    )
    assert costly.finish_reason == "error" and "--grammar-mask-ms" in costly.error
    assert costly.error_code == "invalid_request"
    assert fused.token_ids == alone
    assert not llm.engine.grammars.cached(Structured("regex", "[a-z]+"))  # a costly grammar is not kept


def test_a_mask_over_budget_through_the_daemon_is_an_invalid_request_not_an_internal_error(llama_dir):
    srv = Server(llama_dir, "--grammar-mask-ms", "0", "--grammar-mask-burst-ms", "0")
    try:
        with srv.client() as c:
            with pytest.raises(FloverError) as e:
                c.generate(input_ids=[1, 2], max_new_tokens=20, structured={"kind": "regex", "value": "[a-z]+"})
            assert e.value.code == "invalid_request" and "--grammar-mask-ms" in e.value.message
    finally:
        srv.stop()


def test_a_grammar_whose_lexer_work_exceeds_the_fuel_is_refused_before_it_runs(llama_dir):
    """200 overlapping lexemes /[a-z]*c[a-z]{n}/: their lexer states multiply (13-165 ms a mask on
    SmolLM2's vocabulary); past --grammar-lexer-fuel the compile check refuses the grammar."""
    lexemes = "\n".join(f"T{i}: /[a-z]*{chr(97 + i % 26)}[a-z]{{{4 + i % 8}}}/" for i in range(200))
    grammar = "start: item+\nitem: " + " | ".join(f"T{i}" for i in range(200)) + "\n" + lexemes
    srv = Server(llama_dir, "--grammar-lexer-fuel", "2000")
    try:
        with srv.client() as c:
            with pytest.raises(FloverError) as e:
                c.generate(input_ids=[1, 2], max_new_tokens=10, structured={"kind": "grammar", "value": grammar})
            assert e.value.code == "invalid_request" and "lexer" in e.value.message
            assert len(e.value.message) < 1000  # no parser state dump
    finally:
        srv.stop()


def test_the_grammar_cache_is_bounded_by_bytes(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    grammars = Grammars(llm.engine.tokenizer, llm.engine.model_config.vocab_size, (0,), GrammarLimits(cache_mib=2))
    for n in range(12):  # ~30 KB of text each, ~0.5 MB compiled
        choices = [f"word{n}-{i}-" + "x" * 20 for i in range(1000)]
        grammars.compile(Structured("json_schema", json.dumps({"enum": choices})))
        assert grammars.cached_bytes <= 2 << 20
    assert 0 < len(grammars._compiled) < 12
    assert grammars.cached_bytes == sum(cost for _, cost in grammars._compiled.values())


def test_numbers_cannot_run_away_but_bounded_ones_keep_their_own_bounds(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    tok, grammars = llm.engine.tokenizer, llm.engine.grammars
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "number"},
            "i": {"type": "integer"},
            "big": {"type": "integer", "maximum": 10**18},
        },
        "required": ["n", "i", "big"],
    }
    grammar = Structured("json_schema", json.dumps(schema)).grammar()

    def takes(text: str) -> bool:
        matcher = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
        ids = tok.encode(text, False)
        return matcher.try_consume_tokens(ids) == len(ids)

    assert takes('{"n":-12.5,"i":42,"big":7')
    assert not takes('{"n":1' + "1" * len(str(NUMBER_BOUND)))  # 16 integer digits at most
    assert not takes('{"n":1.1234567')  # 6 decimals at most
    assert not takes('{"n":1,"i":1' + "2" * len(str(NUMBER_BOUND)))
    assert takes('{"n":1,"i":1,"big":' + "9" * 18)  # the schema's own bound stands
    any_json = Structured("json").grammar()
    matcher = llguidance.LLMatcher(grammars.tokenizer, any_json, log_level=0)
    ids = tok.encode('{"a":[1' + "1" * 20, False)
    assert matcher.try_consume_tokens(ids) < len(ids)


def _raw(addr: str, message: bytes) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    try:
        sock.send(message)
        assert sock.poll(20_000), "no answer"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)


def test_every_message_the_daemon_cannot_take_is_answered_with_its_id(server):
    deep = "[" * 5000 + "]" * 5000  # a schema as text nesting past any parser's recursion
    answer = _raw(
        server.addr,
        msgpack.packb(
            {
                "op": "generate",
                "id": "deep",
                "input_ids": [1, 2],
                "params": {"max_new_tokens": 4, "structured": {"kind": "json_schema", "value": deep}},
            }
        ),
    )
    assert answer["event"] == "error" and answer["id"] == "deep" and answer["code"] == "invalid_request"
    assert "nests deeper" in answer["message"]
    # integer map keys: msgpack's strict reading refuses the message, its id is still read
    answer = _raw(
        server.addr,
        msgpack.packb(
            {
                "op": "generate",
                "id": "keys",
                "input_ids": [1, 2],
                "params": {"max_new_tokens": 4, "logit_bias": {1: 2.0}},
            }
        ),
    )
    assert answer["event"] == "error" and answer["id"] == "keys" and answer["code"] == "bad_message"
    with server.client() as c:  # the client library sends OpenAI's map form as the wire's pairs
        out = c.generate(input_ids=[1, 2], max_new_tokens=4, ignore_eos=True, logit_bias={7: 100})
        assert out["token_ids"] == [7, 7, 7, 7]
        with pytest.raises(FloverError) as e:  # what the server cannot read is answered with its id
            c.generate(input_ids=[1, 2], max_new_tokens=4, stop={1: "x"})
        assert e.value.code == "bad_message"


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_the_grammar_checker_child_is_gone_with_the_daemon(llama_dir, how):
    import signal

    srv = Server(llama_dir)
    with srv.client() as c:
        c.generate(input_ids=[1, 2], max_new_tokens=4, structured={"kind": "regex", "value": "[a-z]+"})
    children = [
        p
        for p in os.listdir("/proc")
        if p.isdigit() and _parent(p) == srv.proc.pid and b"grammar_sandbox" in _cmdline(p)
    ]
    assert children, "the checker runs as the daemon's child"
    code, _ = srv.stop(getattr(signal, how))
    assert code == (0 if how == "SIGTERM" else -9)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") and b"grammar_sandbox" in _cmdline(p) for p in children):
        assert time.monotonic() < deadline, "the checker outlived the daemon"
        time.sleep(0.1)


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_a_drain_during_a_costly_compile_ends_on_time(llama_dir):
    """SIGTERM while a grammar compiles for long (here allowed 60 s and 4 GiB): the daemon stops
    within its drain timeout and a few seconds (the checker child is killed), and the client of
    the compile is told, not left waiting."""
    import signal
    import threading

    srv = Server(llama_dir, "--drain-timeout", "2", "--grammar-compile-seconds", "60", "--grammar-compile-mib", "4096")
    answers = []
    try:
        with srv.client() as c:

            def bomb():
                try:
                    answers.append(
                        c.generate(
                            input_ids=[1, 2],
                            max_new_tokens=4,
                            structured={"kind": "json_schema", "value": json.dumps(BOMB)},
                        )
                    )
                except FloverError as e:
                    answers.append(e)

            asking = threading.Thread(target=bomb)
            asking.start()
            time.sleep(2)
            stopped = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.proc.wait(timeout=30) == 0
            assert time.monotonic() - stopped < 10
            asking.join(30)
        assert len(answers) == 1 and isinstance(answers[0], FloverError), answers
    finally:
        srv.stop()
