"""docs/cli.md is the parser's own account of every command and flag: stale, it fails here."""

from pathlib import Path

from flover.apps.cli import build_parser
from flover.apps.cli_docs import render

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def test_docs_cli_md_is_what_the_parser_says():
    assert PAGE.read_text() == render(), "docs/cli.md is stale: python -m flover.apps.cli_docs > docs/cli.md"


def test_every_flag_of_every_command_is_on_the_page():
    page = PAGE.read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, command in sub.choices.items():
        assert f"## flover {name}" in page
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page, (name, flag)
