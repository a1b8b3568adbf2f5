"""`flover chat`: an interactive conversation in the terminal.

Each turn sends the whole conversation, rendered with the checkpoint's chat template, and streams
the reply as it is generated. `/reset` starts over (keeping `--system`), Ctrl-D ends the chat,
Ctrl-C stops the reply being written. The engine is in this process (`--model`) or a running
`flover serve` (`--connect`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import Callable, Iterator

from flover.apps.flags import (
    add_connect_args,
    add_engine_args,
    add_sampling_args,
    connect,
    require_model,
    sampling_params,
    start_engine,
)
from flover.config import SamplingParams
from flover.request import RequestInput


class LocalReplies:
    """Replies from an engine in this process."""

    def __init__(self, engine, params: SamplingParams):
        self.engine, self.params, self.last = engine, params, None

    def __call__(self, messages: list[dict]) -> Iterator[str]:
        engine = self.engine
        request = engine.make_request(RequestInput(None, self.params, stream=True, messages=messages))
        rid = engine.enqueue(request)
        try:
            while True:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    if out.text_delta:
                        yield out.text_delta
                    if out.finished:
                        self.last = (out.finish_reason, len(out.prompt_token_ids), len(out.token_ids))
                        return
        finally:
            if engine.abort(rid):  # the caller stopped early (Ctrl-C): free the slot
                while engine.has_unfinished():
                    engine.step()


class RemoteReplies:
    """Replies from a running `flover serve`."""

    def __init__(self, client, params: SamplingParams):
        self.client, self.params, self.last = client, asdict(params), None

    def __call__(self, messages: list[dict]) -> Iterator[str]:
        rid = self.client.new_id()
        done = False
        try:
            for event in self.client.stream(messages=messages, request_id=rid, **self.params):
                if event["event"] == "token" and event.get("text"):
                    yield event["text"]
                elif event["event"] == "final":
                    usage = event["usage"]
                    self.last = (event["finish_reason"], usage["prompt_tokens"], usage["completion_tokens"])
                    done = True
        finally:
            if not done:
                self.client.cancel(rid)


def chat_loop(
    reply, system: str | None = None, read: Callable[[str], str] = input, out=sys.stdout, err=sys.stderr
) -> int:
    """Read user turns until end of input; stream each reply. Returns the exit code."""
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    print("flover chat: type a message; /reset starts over; Ctrl-D quits.", file=err, flush=True)
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=err)
            return 0
        except KeyboardInterrupt:
            print(file=err)
            continue
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(base)
            print("(conversation reset)", file=err, flush=True)
            continue
        messages.append({"role": "user", "content": line})
        pieces, start = [], time.perf_counter()
        try:
            for piece in reply(messages):
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            print("\n(stopped)", file=err, flush=True)
        except ValueError as e:  # e.g. the conversation no longer fits in max_seq_len
            print(f"\nflover chat: {e}; /reset to start over", file=err, flush=True)
            messages.pop()
            continue
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": "".join(pieces).strip()})
        if reply.last is not None:
            finish, prompt_tokens, tokens = reply.last
            elapsed = time.perf_counter() - start
            print(
                f"[{finish}, {tokens} tokens, prompt {prompt_tokens} tokens, {tokens / elapsed:.1f} tok/s]",
                file=err,
                flush=True,
            )


def add_chat_command(sub) -> None:
    chat = sub.add_parser("chat", help="an interactive chat in the terminal (the checkpoint's chat template)")
    add_engine_args(chat, model_required=False)
    add_sampling_args(chat)
    add_connect_args(chat)
    chat.add_argument("--system", default=None, help="a system message that starts every conversation")
    chat.set_defaults(func=cmd_chat, max_new_tokens=512)


def cmd_chat(args: argparse.Namespace) -> int:
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
