"""A model's chat template is input: it is compiled and rendered in a bounded child process.

Jinja's sandbox stops a template from reaching Python's internals, but not from costing time or
memory: two nested `range(100000)` loops are 10^10 iterations, `{{ 'a' * 10**9 }}` is folded into
a gigabyte constant when the template compiles, `{{ m.content * 10**8 }}` makes gigabytes per chat.
None of it can be interrupted inside the server's own process. So the server only parses the
template (its syntax: linear in its size); a child (child_process.py) compiles it, with its
address space capped (`TemplateLimits.mib` over its start-up size), and renders each chat within
`TemplateLimits.seconds`, killed past either and started afresh for the next chat. A rendered
text longer than the request could use (`max_bytes`) is refused in the child.

The variables cross as msgpack (messages, tools and template kwargs are JSON values).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from flover.child_process import BoundedChild, ChildStopped, cap_address_space, read_frame, write_frame
from flover.flags import flag


@dataclass(frozen=True)
class TemplateLimits:
    """What rendering one chat may cost (docs/hardening.md): seconds, and MiB of address space
    over the child's start-up size (real templates: a few ms and well under a MiB)."""

    seconds: float = field(
        default=2.0,
        metadata=flag(
            "--template-seconds",
            "the model's chat template renders each chat in a child process, killed after S seconds "
            "(the request gets a 400 naming the limit; default %(default)g)",
            metavar="S",
        ),
    )
    mib: int = field(
        default=256,
        metadata=flag(
            "--template-mib", "... and held to MIB of memory, its compile too (default %(default)d)", metavar="MIB"
        ),
    )


class TemplateLimitReached(ValueError):
    """A chat whose rendering passes a limit: the request's own problem (a 400)."""


def parse_template(source: str) -> None:
    """Jinja's syntax check alone (no compile, so no constant is folded): raises TemplateSyntaxError."""
    _environment().parse(source)


class TemplateSandbox:
    """The server's side: `render(variables, max_bytes)` -> the text, or TemplateLimitReached naming
    the limit, or ValueError with the template's own refusal. Started on the first chat."""

    def __init__(self, source: str, limits: TemplateLimits = TemplateLimits()):
        self.limits = limits
        self.child = BoundedChild(
            "flover.chat_template", {"source": source, "mib": limits.mib}, greets=True, idle=False
        )

    def render(self, variables: dict, max_bytes: int) -> str:
        try:
            reply = self.child.ask({"variables": variables, "max_bytes": max_bytes}, self.limits.seconds)
        except ChildStopped as stopped:
            raise self._over_limit(stopped) from None
        if reply.get("error") is not None:
            raise ValueError(reply["error"])
        return reply["text"]

    def start(self) -> None:
        """Start the child now, compiling the template (a server, before it serves): the first chat
        does not wait for the child's start-up."""
        self.child.start()

    def _over_limit(self, stopped: ChildStopped) -> TemplateLimitReached:
        if not stopped.sent:
            return TemplateLimitReached("the chat template's child process stopped; try again")
        what = "to compile" if stopped.at_start else "to render these messages"
        if stopped.timed_out:
            return TemplateLimitReached(
                f"the chat template took longer than the server's limit of {self.limits.seconds:g} s "
                f"{what} (--template-seconds)"
            )
        return TemplateLimitReached(
            f"the chat template needed more memory than the server's limit of {self.limits.mib} MiB "
            f"{what} (--template-mib)"
        )

    def close(self) -> None:
        self.child.close()


def _environment():
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


def _serve() -> int:
    """The child: its cap, the template compiled (greeting the server with the error if it does
    not), then one render per frame."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_frame(stdin)
    if setup is None:
        return 1
    env = _environment()  # (jinja2 imported before the cap)
    cap_address_space(setup["mib"])
    try:
        template, error = env.from_string(setup["source"]), None
    except MemoryError:
        return 3  # the parent reads EOF: over the memory limit
    except Exception as e:
        template, error = None, f"the chat template does not compile ({type(e).__name__}: {e})"
    write_frame(stdout, {"error": error})
    while True:
        job = read_frame(stdin)
        if job is None:
            return 0
        if template is None:
            write_frame(stdout, {"error": error})
            continue
        try:
            text = template.render(**job["variables"])
        except MemoryError:
            return 3
        except Exception as e:  # the template's own raise_exception, or a template bug
            write_frame(stdout, {"error": f"the chat template refused these messages: {e}"})
            continue
        if len(text) > job["max_bytes"]:  # (characters: at least one byte each)
            write_frame(stdout, {"error": f"the rendered chat is over {job['max_bytes']} bytes: it cannot fit"})
            continue
        write_frame(stdout, {"text": text})
