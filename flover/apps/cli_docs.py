"""docs/cli.md, written from the parser itself (a test fails when the page is stale):

python -m flover.apps.cli_docs > docs/cli.md
"""

from __future__ import annotations

import argparse
import sys

from flover.apps.cli import build_parser

HEADER = """# Command line reference

Generated from `flover --help` by `python -m flover.apps.cli_docs > docs/cli.md`; do not edit by
hand (tests/test_cli_docs.py fails when it is stale). Every command takes `-v` / `--verbose`.
"""


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("%%", "%")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
    if action.choices:
        names += " {" + ", ".join(map(str, action.choices)) + "}"
    elif action.nargs != 0 and action.option_strings:
        names += f" {action.metavar or action.dest.upper()}"
    return names


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    if not action.help:
        return ""
    try:
        return _cell(action.help % {**vars(action), "prog": "flover"})
    except (KeyError, TypeError, ValueError):
        return _cell(action.help)


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    """(title, table rows) of each option group of a command."""
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            title = group.title if group.title not in ("options", "optional arguments") else "options"
            out.append((title, [f"| {_flag(a)} | {_default(a)} | {_help(a)} |" for a in actions]))
    return out


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def _table(rows: list[str]) -> list[str]:
    return ["| flag | default | what it does |", "|---|---|---|", *rows, ""]


def render() -> str:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    summaries = {choice.dest: choice.help for choice in sub._choices_actions}
    groups = {name: _groups(command) for name, command in sub.choices.items()}
    # groups several commands share alike (engine, sampling, ...): one table, linked from each
    seen: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for name, command_groups in groups.items():
        for title, rows in command_groups:
            seen.setdefault((title, tuple(rows)), []).append(name)
    shared = {key for key, users in seen.items() if len(users) > 1}
    lines = [HEADER]
    lines += [f"* `flover {name}`: {_cell(summaries.get(name, ''))}" for name in sub.choices]
    lines.append("")
    for name, command in sub.choices.items():
        lines += [f"## flover {name}", "", _cell(command.description or summaries.get(name, "")), ""]
        for title, rows in groups[name]:
            if (title, tuple(rows)) in shared:
                lines += [f"**{title}**: see [{title} options](#{_anchor(title + ' options')})", ""]
            else:
                lines += [f"**{title}**", "", *_table(rows)]
    for title, rows in (key for key in seen if key in shared):
        users = ", ".join(f"`{u}`" for u in seen[(title, rows)])
        lines += [f"## {title} options", "", f"Taken by {users}.", "", *_table(list(rows))]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
