"""Print the commands reference (docs/reference/commands.md) from nodeguard's command-line parser.

    .venv/bin/python scripts/commands_reference.py > docs/reference/commands.md

Every command, its help and description, and every argument with its help,
value, default and choices come from the parser that ``nodeguard`` itself runs
(``nodeguard.surfaces.cli.command_parsers``). What a parser cannot say is kept
here: each command's exit codes (``EXIT_CODES``), examples and the guides to
read. A command without exit codes here, or an argument without help, stops the
generator, so neither can go undocumented. Not imported by the daemon.
"""

from __future__ import annotations

import argparse
import sys

from nodeguard.surfaces.cli import command_parsers

COMMAND = ".venv/bin/python scripts/commands_reference.py > docs/reference/commands.md"

CONFIG_ERRORS = [
    (1, "the config is invalid (every error with its JSON path)"),
    (2, "the config file cannot be read"),
]
# The exit codes each command defines, besides 0 (done), 2 (a usage error) and 130 (Ctrl-C), which every command has.
EXIT_CODES: dict[str, list[tuple[int | str, str]]] = {
    "snapshot": [(1, "the config is invalid, or the node's cgroups or /proc cannot be read"), CONFIG_ERRORS[1]],
    "check-config": [(0, "the config is valid"), *CONFIG_ERRORS],
    "schema": [],
    "run": [
        (0, "stopped cleanly by SIGTERM or SIGINT, also during start-up or while waiting for the node"),
        (1, "the config is invalid, or nodeguard cannot start (e.g. another nodeguard, on another ledger, acts on "
            "the node)"),
        (2, "the config file cannot be read"),
    ],
    "plan": [
        (1, "the config is invalid, a `--what-if` names no metric or gives no number, or the node cannot be read"),
        CONFIG_ERRORS[1],
    ],
    "demo": [],
    "status": [
        (1, "the daemon's /status cannot be read (not running, or `http.enabled` off), or the config is invalid"),
        CONFIG_ERRORS[1],
    ],
    "gate": [
        ("COMMAND's", "COMMAND's own exit status once it ran (128 + N when signal N ended it)"),
        (1, "the gate refused the request, or no COMMAND was given"),
        (
            75,
            "the daemon could not be reached (or did not answer) within `--connect-timeout`, or the load failed "
            "before admission (e.g. a dependency failed); COMMAND did not run",
        ),
        (127, "COMMAND could not be run"),
    ],
    "admit": [
        (0, "admitted, or the daemon could not be reached and `--if-unavailable admit` was given"),
        (1, "the gate refused the request, or the load failed before admission (e.g. a dependency failed)"),
        (75, "the daemon could not be reached (or did not answer) within `--connect-timeout`"),
    ],
    "oci-hook": [
        (0, "admitted (createRuntime) or released (poststop)"),
        (1, "the gate refused the container, or the OCI state on stdin is not one the hook can read"),
        (75, "the daemon could not be reached within `--connect-timeout`"),
        (77, "the gate socket's mode or owner keeps the hook's user out"),
    ],
    "gatectl": [
        (1, "the gate refused the request (e.g. no such load), or no load was named for ready, release or cancel"),
        (75, "the daemon could not be reached within `--connect-timeout`"),
    ],
    "restore": [
        (1, "a restore failed, or a running daemon acts on the node (stop it: SIGTERM restores too)"),
        (2, "the config file cannot be read"),
    ],
    "held": [
        (0, "the ledger was read (no ledger file: nothing held)"),
        (
            1,
            "the ledger cannot be read (not JSON, an unknown version, a symbolic link, or not nodeguard's), some of "
            "its records fail their checks (listed as rejected), or the config is invalid",
        ),
        (2, "the config file cannot be read"),
    ],
    "why": [
        (0, "answered, also when the history has nothing on the pod"),
        (1, "`--since` or `--at` is not a time, or the config is invalid"),
        CONFIG_ERRORS[1],
    ],
}
EXAMPLES: dict[str, list[str]] = {
    "check-config": ["nodeguard check-config /etc/nodeguard/config.json --node-name worker-7"],
    "plan": ["nodeguard plan --what-if cpu_total_utilization=95 --config /etc/nodeguard/config.json"],
    "snapshot": ["nodeguard snapshot --watch 5"],
    "gate": ["nodeguard gate --name db --ready-tcp 127.0.0.1:5432 -- /usr/bin/postgres -D /var/lib/postgres"],
    "admit": ["nodeguard admit --name jvm-warmup --semaphore heavy-start --connect-timeout 60"],
    "gatectl": ["nodeguard gatectl status", "nodeguard gatectl ready db"],
    "restore": ["nodeguard restore --all --config /etc/nodeguard/config.json"],
    "held": ["nodeguard held --ledger /run/nodeguard/ledger.json"],
    "why": [
        "nodeguard why batch/etl-7 --at 2024-05-01T14:02:00",
        "nodeguard why 3f1c2a9e-0d4b-4c1e-9f60-2b7d5c8e1a42 --since -1h --json",
    ],
}
SEE_ALSO = {
    "demo": "[Getting started on a host](../getting-started/host.md)",
    "run": "[Operations](../operations.md), [Safety and reliability](safety.md)",
    "check-config": "[Configuration](configuration.md)",
    "plan": "[Troubleshooting](../troubleshooting.md)",
    "status": "[Monitoring and alerts](../monitoring.md)",
    "gate": "[Gating starts](../gate.md)",
    "admit": "[Gating starts](../gate.md), [Cluster caps](../cluster-caps.md)",
    "oci-hook": "[Gating starts](../gate.md)",
    "gatectl": "[Gating starts](../gate.md)",
    "restore": "[Operations](../operations.md#stop-crash-restart-what-is-left-behind), [recovering a Kubernetes "
    "node](../operations.md#recovering-a-kubernetes-node)",
    "held": "[Operations](../operations.md#recovering-a-kubernetes-node)",
    "why": "[Troubleshooting](../troubleshooting.md#why-was-this-pod-held-back)",
}


class Undocumented(Exception):
    pass


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def _groups(parser: argparse.ArgumentParser) -> list[list[argparse.Action]]:
    return [list(group._group_actions) for group in parser._mutually_exclusive_groups]


def value_of(action: argparse.Action) -> str:
    """What an argument takes: its value's name, or its choices; nothing for a flag."""
    if action.nargs in (0, argparse.REMAINDER):
        return ""
    if action.choices is not None and action.metavar is None:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    name = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    return f"`{name}`"


def _value_name(action: argparse.Action, positional: bool) -> str:
    if action.choices is not None and action.metavar is None:
        return "|".join(str(choice) for choice in action.choices)
    if isinstance(action.metavar, str):
        return action.metavar
    return action.dest if positional else action.dest.upper()


def _token(action: argparse.Action) -> str:
    if not action.option_strings:
        return _value_name(action, positional=True)
    option = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    return option if action.nargs == 0 else f"{option} {_value_name(action, positional=False)}"


def synopsis(prog: str, parser: argparse.ArgumentParser) -> str:
    """The command's usage on one line: optional arguments in brackets, exclusive ones joined by |."""
    grouped = {id(action): group for group in _groups(parser) for action in group}
    parts, shown = [prog], set()
    for action in _arguments(parser):
        group = grouped.get(id(action))
        if group is not None:
            if id(group[0]) not in shown:
                shown.add(id(group[0]))
                parts.append("[" + " | ".join(_token(a) for a in group) + "]")
        elif action.required or (not action.option_strings and action.nargs not in ("?", "*")):
            parts.append(_token(action))
        else:
            parts.append(f"[{_token(action)}]")
    return " ".join(parts)


def default_of(action: argparse.Action) -> str:
    if action.nargs == argparse.REMAINDER:
        return ""  # the rest of the line, however short
    if action.required:
        return "*required*"
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def meaning_of(command: str, action: argparse.Action) -> str:
    if not action.help:
        name = action.option_strings[0] if action.option_strings else action.dest
        raise Undocumented(f"{command} {name}: no help in its parser")
    text = action.help % {**vars(action), "prog": command} if "%" in action.help else action.help
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        text += " (repeatable)"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:].rstrip(".") + "."


def argument_table(command: str, parser: argparse.ArgumentParser) -> list[str]:
    arguments = _arguments(parser)
    if not arguments:
        return ["No arguments.", ""]
    out = ["| argument | value | default | meaning |", "|---|---|---|---|"]
    for action in arguments:
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
        if not action.option_strings and action.choices is not None:
            name = f"`{action.dest}`"
        out.append(f"| {name} | {value_of(action)} | {default_of(action)} | {_cell(meaning_of(command, action))} |")
    out.append("")
    for group in _groups(parser):
        out += ["At most one of " + ", ".join(f"`{a.option_strings[0]}`" for a in group) + ".", ""]
    return out


def render() -> str:
    top, commands = command_parsers()
    missing = set(commands) - set(EXIT_CODES)
    if missing:
        raise Undocumented(f"no exit codes for {', '.join(sorted(missing))} in scripts/commands_reference.py")
    out = [
        "# Commands",
        "",
        "<!-- Generated by scripts/commands_reference.py from nodeguard's command-line parser: "
        "do not edit by hand. -->",
        f"<!-- Regenerate: {COMMAND} -->",
        "",
        "`nodeguard [--log-level LEVEL] COMMAND [ARGUMENTS]`. Each command's `--help` shows its arguments as its "
        "section here does. The commands that read the config (`--config`) pick this node's settings by its name "
        "and labels ([how rules combine](configuration.md#pernode)).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name in commands:
        out.append(f"| [`{name}`](#nodeguard-{name}) | {_cell(_help_of(top, name))} |")
    out += [
        "",
        "Every command exits 0 when done, 2 on a usage error (an unknown option, a missing argument: argparse's "
        "message) and 130 on Ctrl-C; each section lists the codes its command adds.",
        "",
        "## Options before the command",
        "",
        *argument_table("nodeguard", top),
    ]
    for name, parser in commands.items():
        out += [f"## `nodeguard {name}`", "", _sentence(_help_of(top, name)), ""]
        if parser.description:
            out += [parser.description, ""]
        out += ["```", synopsis(f"nodeguard {name}", parser), "```", ""]
        out += argument_table(name, parser)
        codes = EXIT_CODES[name]
        if codes:
            out += ["| exit code | meaning |", "|---|---|"]
            out += [f"| {code} | {_cell(meaning)} |" for code, meaning in codes]
            out.append("")
        if name in EXAMPLES:
            out += ["```sh", *EXAMPLES[name], "```", ""]
        if name in SEE_ALSO:
            out += [f"See also {SEE_ALSO[name]}.", ""]
    return "\n".join(out)


def _help_of(top: argparse.ArgumentParser, name: str) -> str:
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name and choice.help:
                    return str(choice.help)
    raise Undocumented(f"{name}: no help in its parser")


def main() -> int:
    try:
        sys.stdout.write(render())
    except Undocumented as exc:
        print(f"commands_reference: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
