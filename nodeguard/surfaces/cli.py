"""The ``nodeguard`` command line."""

from __future__ import annotations

import argparse
import sys

from nodeguard import __version__
from nodeguard.errors import ConfigError, ConfigUnreadable, NodeguardError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see below)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from typing import Any

    from nodeguard.config import Settings
    from nodeguard.model.snapshot import Snapshot

# Only argparse at the top: each command imports what it runs, so `nodeguard oci-hook` (on every container
# create) and `nodeguard admit` start about as fast as a bare interpreter (tests/test_imports.py, bench/startup.py).

EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2


def _path(text: str) -> Path:
    """``type=Path`` for argparse, importing pathlib only when a path is given."""
    from pathlib import Path

    return Path(text)


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it ($COLUMNS, stdout's terminal, 80)."""
    import os

    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Formatter(argparse.HelpFormatter):
    """argparse's help, sized without importing shutil (and with it bz2 and lzma) to build every parser."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, _columns() - 2 if width is None else width)


if TYPE_CHECKING:
    _Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]
    Options = Callable[[argparse.ArgumentParser], None]  # adds a command's options to its parser
else:
    _Subcommands = argparse._SubParsersAction  # generic for type checkers only


class Commands(_Subcommands):
    """The subcommands, each listed in the help at once but its parser made, and its options added, only when it
    is the one run (or its help is shown): the OCI hook does not build a dozen parsers it does not use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, tuple[Options | None, dict[str, Any]]] = {}

    def command(self, name: str, options: Options | None, *, help: str, **kwargs: Any) -> None:
        """A subcommand; ``options`` adds its options, ``kwargs`` (``description``) go to its parser."""
        self._choices_actions.append(self._ChoicesPseudoAction(name, (), help))  # as add_parser(help=...) does
        self._name_parser_map[name] = None  # type: ignore[assignment]  # a valid choice; made in __call__
        self.pending[name] = (options, kwargs)

    def built(self, name: str) -> argparse.ArgumentParser:
        """The parser of command ``name``, made now if it was not yet."""
        if name in self.pending:
            options, kwargs = self.pending.pop(name)
            del self._name_parser_map[name]
            sub = self.add_parser(name, formatter_class=_Formatter, **kwargs)
            if options is not None:
                options(sub)
        return self._name_parser_map[name]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, list) and values
        self.built(values[0])
        super().__call__(parser, namespace, values, option_string)


def _with_config(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--config", "-c", type=_path, metavar="FILE", help="the JSON config file (default: built-in defaults)"
    )
    sub.add_argument("--node-name", metavar="NAME", help="this node's name (default: $NODE_NAME or the hostname)")
    sub.add_argument(
        "--node-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label of this node, for perNode rules (repeatable)",
    )


def _snapshot_options(snap: argparse.ArgumentParser) -> None:
    _with_config(snap)
    snap.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    snap.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS until Ctrl-C")
    snap.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="between the two reads that rates come from"
    )


def _check_options(check: argparse.ArgumentParser) -> None:
    check.add_argument("file", type=_path, help="the config file to check")
    check.add_argument(
        "--node-name",
        metavar="NAME",
        help="check the settings merged for this node (default: $NODE_NAME or the hostname)",
    )
    check.add_argument(
        "--node-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label of the node, for perNode rules (repeatable)",
    )


def _run_options(run: argparse.ArgumentParser) -> None:
    _with_config(run)
    run.add_argument("--dry-run", action="store_true", help="log every write and eviction instead of making it")


def _plan_options(plan: argparse.ArgumentParser) -> None:
    _with_config(plan)
    plan.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="METRIC=VALUE",
        help="pretend the node's METRIC is VALUE, e.g. cpu_total_usage=7.5 (repeatable)",
    )
    plan.add_argument("--json", action="store_true", help="the decision trace as one JSON line")
    plan.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="between the two reads that rates come from"
    )


def _demo_options(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--seconds", type=float, default=30.0, metavar="SECONDS", help="how long the demo runs")


def _status_options(status: argparse.ArgumentParser) -> None:
    _with_config(status)
    status.add_argument("--json", action="store_true", help="the raw /status JSON")


def _restore_options(restore: argparse.ArgumentParser) -> None:
    _with_config(restore)
    restore.add_argument(
        "--all", action="store_true", required=True, help="every record of the ledger (required: nothing less is done)"
    )
    restore.add_argument(
        "--ledger", metavar="FILE", help="the ledger file (default: actuation.ledgerPath of the config)"
    )


def _held_options(held: argparse.ArgumentParser) -> None:
    _with_config(held)
    held.add_argument("--ledger", metavar="FILE", help="the ledger file (default: actuation.ledgerPath of the config)")
    held.add_argument(
        "--json", action="store_true", help="one JSON object: every lever's held groups, as /status has them"
    )


def _why_options(why: argparse.ArgumentParser) -> None:
    why.add_argument("pod", metavar="POD", help="the pod: namespace/name, its UID, or its cgroup path (workload id)")
    why.add_argument(
        "--since",
        metavar="TIME",
        help="only what was done from TIME on: ISO 8601 (local time unless it has a zone) or relative, like -15m",
    )
    why.add_argument(
        "--at", metavar="TIME", help="what held the pod back at TIME, and what was done until then (default: now)"
    )
    why.add_argument("--json", action="store_true", help="the answer as one JSON object")
    _with_config(why)
    why.add_argument("--history", metavar="DIR", help="the history's directory (default: history.path of the config)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodeguard", description=__doc__, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"nodeguard {__version__}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least level logged; before the command: nodeguard --log-level debug run",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=Commands)
    assert isinstance(commands, Commands)
    commands.command(
        "snapshot",
        _snapshot_options,
        help="show node and per-workload usage now",
        description="Read the node and its workloads twice, --interval apart, and show the node's CPU, load, memory "
        "and pressure, and each workload's cores, CPU quota, throttling, memory and CPU stall. Changes nothing.",
    )
    commands.command(
        "check-config",
        _check_options,
        help="validate a config file; exit 1 if invalid, 2 if unreadable",
        description="Validate a config file as nodeguard run does, every error with its JSON path, and say which "
        "perNode rules apply to this node.",
    )
    commands.command(
        "schema",
        None,
        help="print the config's JSON Schema",
        description="Print the JSON Schema of the config file (also packaging/nodeguard.schema.json), for editors.",
    )
    commands.command(
        "run",
        _run_options,
        help="run the daemon: the guard, the start gate and cluster coordination",
        description="Sense, plan, act and record every tick until stopped. SIGTERM or SIGINT stops it and puts back "
        "every lever it holds (CPU quotas and weights, memory.high) unless actuation.onExit is keep, or hands them "
        "over to a successor waiting for the node; SIGHUP reloads the config file. Started while a nodeguard on the "
        "same ledger holds the node, it waits and takes over when that one stops.",
    )
    commands.command(
        "plan",
        _plan_options,
        help="show what the guard would do now, without acting",
        description="Read the node twice, --interval apart, and show what the guard would do now: readings against "
        "the waterlines, gaps, actions, blocked metrics, the rule that makes each workload a candidate, protected "
        "or exempt, and every candidate's sort keys (with kubernetes.enabled, the node's pods are listed once for "
        "their metadata). Changes nothing.",
    )
    commands.command(
        "demo",
        _demo_options,
        help="watch nodeguard throttle burners on this machine (about 30 s)",
        description="Create scratch cgroups with an important workload and four CPU burners, run the guard against "
        "them with a live view, and remove everything at the end. Where it may not create cgroups, a dry run on "
        "this machine's own cgroups.",
    )
    commands.command(
        "status",
        _status_options,
        help="the running daemon's status (reads its /status endpoint)",
        description="Show the running daemon's /status (at http.listen of the config): the node against its "
        "waterlines, what it holds back with original and current values, the gate, the cluster's semaphores.",
    )

    commands.command(
        "why",
        _why_options,
        help="what nodeguard did to a pod, when and why (the decision history); works while the daemon is down",
        description="Read the decision history and show what nodeguard did to POD and why: each lever change and "
        "eviction with the readings, gaps, objective, the pod's rank among the candidates and the rule that made it "
        "one; holds on a group above the pod (its QoS tier's weight) included; and what held it back at --at.",
    )

    from nodeguard.gate.commands import add_gate_commands

    add_gate_commands(commands)  # gate, admit, oci-hook, gatectl: each sets its own handler
    commands.command(
        "restore",
        _restore_options,
        help="put back every lever recorded in the ledger; works while the daemon is down",
        description="Put back every CPU quota, CPU weight and memory.high recorded in the ledger, one line per group "
        "with its outcome. Refuses while a daemon acts on the node: stop it instead (SIGTERM restores too).",
    )
    commands.command(
        "held",
        _held_options,
        help="what the ledger records as held; works while the daemon is down",
        description="Show every group the ledger records as held back: its lever, the value it is held at, its "
        "original, since when and why, and the children changed with it. Reads only the ledger file: not the "
        "kernel, not the node's lock, so it answers with or without a daemon; changes nothing.",
    )
    return parser


def command_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser and every command's, all made (a run makes only its own): for the reference."""
    parser = _parser()
    commands = next(action for action in parser._actions if isinstance(action, Commands))
    return parser, {name: commands.built(name) for name in list(commands.choices)}


def load_settings(args: argparse.Namespace) -> Settings:
    from nodeguard.config import Document, load_document
    from nodeguard.node_identity import node_labels

    document = load_document(args.config) if args.config else Document()
    labels = node_labels(args.node_name, args.node_label)
    return document.settings_for(labels, str(args.config or "defaults"))


def cmd_snapshot(args: argparse.Namespace) -> int:
    import json
    import time

    from nodeguard.sources.sensor import Sensor
    from nodeguard.surfaces.render import render_snapshot, snapshot_data

    sensor = Sensor(load_settings(args))
    try:
        sensor.sense()
        while True:
            time.sleep(max(0.05, args.interval))
            snapshot = sensor.sense()
            if args.json:
                print(json.dumps(snapshot_data(snapshot)), flush=True)
            else:
                print(render_snapshot(snapshot), flush=True)
            if args.watch is None:
                return EXIT_OK
            time.sleep(max(0.0, args.watch - args.interval))
            if not args.json:
                print()
    finally:
        sensor.close()


def cmd_check_config(args: argparse.Namespace) -> int:
    from nodeguard.config import load_document
    from nodeguard.node_identity import node_labels, node_name

    document = load_document(args.file)
    labels = node_labels(args.node_name or node_name(), args.node_label)
    rules = document.matching_rules(labels)
    document.settings_for(labels, str(args.file))
    print(
        f"{args.file}: valid ({len(document.per_node)} perNode rule(s); "
        f"for node {labels['kubernetes.io/hostname']}: rules {rules or 'none'} apply)"
    )
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from nodeguard.actuators.node_lock import NodeBusy
    from nodeguard.config import Document, load_document
    from nodeguard.daemon import Daemon
    from nodeguard.log import get_logger
    from nodeguard.node_identity import node_labels, node_name

    document = load_document(args.config) if args.config else Document()
    name = args.node_name or node_name()
    local = node_labels(name, args.node_label)
    explicit = {pair.partition("=")[0] for pair in args.node_label}
    labels = local
    kube = document.global_.kubernetes
    if kube.enabled and kube.node_labels_from_api:
        from nodeguard.kubernetes.nodes import fetch_node_labels_sync, merge_labels

        # Before the daemon's event loop exists: these labels choose the perNode rules.
        api = fetch_node_labels_sync(kube, name)
        if api is None:
            get_logger("nodeguard").warning(
                "cannot read this node's labels from the API server; perNode rules see only the hostname"
                " and --node-label"
            )
        labels = merge_labels(local, api, explicit)
    settings = document.settings_for(labels, str(args.config or "defaults"))
    try:
        daemon = Daemon(
            settings,
            config_path=args.config,
            labels=labels,
            dry_run=args.dry_run,
            node=name,
            local_labels=local,
            explicit_labels=explicit,
        )
    except NodeBusy as exc:
        get_logger("nodeguard").error("not starting: refusing to act beside another nodeguard", error=str(exc))
        return EXIT_INVALID
    if not daemon.settings.http.enabled:  # nothing to serve: no HTTP server, no metrics (only at start, as HTTP)
        return asyncio.run(daemon.run())
    from nodeguard.surfaces.http import HttpServer
    from nodeguard.surfaces.metrics import Metrics
    from nodeguard.surfaces.status import history_of, status_of

    metrics = Metrics(daemon.view)
    daemon.on_tick.append(metrics.tick_duration.observe)
    daemon.gate.on_admission = metrics.gate_wait.observe
    history = (lambda params: history_of(daemon, params)) if daemon.settings.history.enabled else None
    http = HttpServer(metrics.registry, daemon.health, lambda: status_of(daemon), daemon.waiting, history)
    return asyncio.run(daemon.run(serve=http.start))


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    import time

    from nodeguard.policy.planner import plan
    from nodeguard.policy.state import GuardState
    from nodeguard.policy.trace import plan_to_data
    from nodeguard.policy.whatif import parse_overrides, what_if
    from nodeguard.sources.sensor import Sensor
    from nodeguard.surfaces.render import render_plan

    overrides = parse_overrides(args.what_if)  # bad names fail before anything is read
    settings = load_settings(args)
    sensor = Sensor(settings)
    try:
        sensor.sense()
        time.sleep(max(0.05, args.interval))
        snapshot = what_if(sensor.sense(), overrides)
    finally:
        sensor.close()
    if settings.kubernetes.enabled:
        snapshot = _with_pod_metadata(snapshot, settings, args.node_name)
    result = plan(snapshot, GuardState.primed(), settings.guard)
    if args.json:
        print(json.dumps(plan_to_data(result)))
    else:
        print(render_plan(result))
    return EXIT_OK


def _with_pod_metadata(snapshot: Snapshot, settings: Settings, node: str | None) -> Snapshot:
    """The pods' metadata laid over the snapshot as the daemon lays it, from one list of this node's pods (a failed
    list is logged: its pods are then left alone, as the daemon leaves them)."""
    import asyncio

    from nodeguard.kubernetes.integration import Kubernetes
    from nodeguard.node_identity import node_name

    kube = Kubernetes(settings.kubernetes, node or node_name(), dry_run=True)

    async def listed() -> None:
        try:
            await kube.refresher.refresh_once()
        finally:
            await kube.aclose()

    asyncio.run(listed())
    return kube.enrich(snapshot)


def cmd_restore(args: argparse.Namespace) -> int:
    from nodeguard.actuators import levers
    from nodeguard.actuators.cgroup_writer import CgroupWriter
    from nodeguard.actuators.ledger import Ledger
    from nodeguard.actuators.node_lock import NodeBusy, hold_node
    from nodeguard.actuators.restore import Outcome, restore_all
    from nodeguard.sources.paths import detect_layout

    settings = load_settings(args)
    path = args.ledger or settings.actuation.ledger_path
    layout = detect_layout(settings.sensing.cgroup_root, settings.sensing.cgroup_version)
    try:
        with hold_node(layout.writable, settings.sensing.proc_root):
            ledger = Ledger.load(path)
            if not ledger:
                print(f"{path}: nothing to restore")
                return EXIT_OK
            records = {record.group: record.lever for record in ledger}
            outcomes = restore_all(ledger, levers.build(CgroupWriter(layout.writable), layout.version))
    except NodeBusy as exc:
        print(f"nodeguard: {exc}; stop it first (SIGTERM restores)", file=sys.stderr)
        return EXIT_INVALID
    for outcome, groups in sorted(outcomes.items()):
        for group in groups:
            print(f"{outcome.value:9} {records.get(group, ''):10} {group}")
    return EXIT_INVALID if Outcome.FAILED in outcomes else EXIT_OK


def cmd_held(args: argparse.Namespace) -> int:
    from nodeguard.surfaces.held import show_held

    path = args.ledger or load_settings(args).actuation.ledger_path
    return EXIT_OK if show_held(path, args.json) else EXIT_INVALID


def cmd_why(args: argparse.Namespace) -> int:
    from nodeguard.history.jsonl import json_text
    from nodeguard.history.query import BadQuestion, Question, answer, read
    from nodeguard.surfaces.why import render

    try:
        question = Question.of(args.pod, args.since, args.at)
    except BadQuestion as exc:
        print(f"nodeguard: {exc}", file=sys.stderr)
        return EXIT_INVALID
    directory = args.history or load_settings(args).history.path
    result = answer(read(directory, question), question)
    print(json_text(result, None) if args.json else render(result, directory))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from nodeguard.surfaces.status_view import fetch_status, show

    listen = load_settings(args).http.listen
    if args.json:
        print(json.dumps(fetch_status(listen)))
    else:
        show(listen)
    return EXIT_OK


def _daemon_logs_json(args: argparse.Namespace) -> bool:
    """The daemon's fatal errors are log events in a JSON log, like everything else it says."""
    from nodeguard.log import json_mode

    return args.command == "run" and json_mode()


def _log_error(event: str, **fields: object) -> None:
    from nodeguard.log import get_logger

    get_logger("nodeguard").error(event, **fields)


def main(argv: Sequence[str] | None = None) -> int:
    from nodeguard.log import configure

    args = _parser().parse_args(argv)
    # The gate's clients (and the OCI hook) print their own messages: logging is set up if something logs.
    configure(args.log_level, lazy=getattr(args, "handler", None) is not None)
    try:
        if args.command == "snapshot":
            return cmd_snapshot(args)
        if args.command == "check-config":
            return cmd_check_config(args)
        handler = getattr(args, "handler", None)
        if handler is not None:
            return int(handler(args))
        if args.command == "run":
            return cmd_run(args)
        if args.command == "demo":
            from nodeguard.surfaces.demo import run_demo

            return run_demo(args.seconds)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "restore":
            return cmd_restore(args)
        if args.command == "held":
            return cmd_held(args)
        if args.command == "why":
            return cmd_why(args)
        if args.command == "schema":
            import json

            from nodeguard.config import json_schema

            print(json.dumps(json_schema(), indent=2))
            return EXIT_OK
    except ConfigError as exc:
        if _daemon_logs_json(args):
            _log_error("config rejected; not starting", source=exc.source, problems=exc.problems)
        else:
            print(exc.render(), file=sys.stderr)
        return EXIT_INVALID
    except ConfigUnreadable as exc:
        if _daemon_logs_json(args):
            _log_error("config unreadable; not starting", error=str(exc))
        else:
            print(exc, file=sys.stderr)
        return EXIT_UNREADABLE
    except (NodeguardError, OSError) as exc:  # sources.paths.LayoutError is a NodeguardError
        if _daemon_logs_json(args):
            _log_error("cannot start", error=str(exc))
        else:
            print(f"nodeguard: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")
