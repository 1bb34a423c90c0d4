"""docs/reference/commands.md is what scripts/commands_reference.py prints from nodeguard's command-line parser."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from nodeguard.surfaces.cli import command_parsers
from tests.docs.generators import load

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference" / "commands.md"


def sections(text: str) -> dict[str, str]:
    """Each command's section of the page, by command."""
    parts = re.split(r"^## `nodeguard ([a-z-]+)`$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_committed_reference_is_what_the_generator_prints() -> None:
    """The committed commands reference equals the generator's output, so it follows every change of the parser."""
    module = load("commands_reference")
    assert REFERENCE.read_text() == module.render(), (
        f"docs/reference/commands.md is out of date; regenerate it: {module.COMMAND}"
    )


def test_every_command_and_every_argument_is_in_its_section() -> None:
    """Each command the parser has, its own section of the page, with a row for each of its arguments (every option
    string, every positional) and each argument's help."""
    _, commands = command_parsers()
    found = sections(REFERENCE.read_text())
    assert list(found) == list(commands)
    for name, parser in commands.items():
        arguments = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        assert arguments or name == "schema", name
        for action in arguments:
            for option in action.option_strings or [str(action.metavar or action.dest)]:
                assert f"`{option}`" in found[name], (name, option)
            assert action.help and action.help.replace("|", "\\|") in found[name], (name, action.dest)


def test_an_argument_without_help_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """An argument whose parser gives it no help fails the generator, naming the command and the argument."""
    module = load("commands_reference")
    top, commands = command_parsers()
    option = next(a for a in commands["plan"]._actions if "--what-if" in a.option_strings)
    monkeypatch.setattr(option, "help", None)
    monkeypatch.setattr(module, "command_parsers", lambda: (top, commands))
    with pytest.raises(module.Undocumented, match=r"plan --what-if"):
        module.render()


def test_a_command_without_exit_codes_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command with no entry in the generator's EXIT_CODES fails it, naming the command."""
    module = load("commands_reference")
    monkeypatch.delitem(module.EXIT_CODES, "restore")
    with pytest.raises(module.Undocumented, match="restore"):
        module.render()


def test_the_cluster_caps_guide_lists_every_option_of_admit_and_links_to_its_reference() -> None:
    """docs/cluster-caps.md names each option of `nodeguard admit` (the init container's command) and links to the
    command's generated section for the rest."""
    guide = (REPO / "docs" / "cluster-caps.md").read_text()
    _, commands = command_parsers()
    for action in commands["admit"]._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                assert f"`{option}`" in guide, option
    assert "(reference/commands.md#nodeguard-admit)" in guide
