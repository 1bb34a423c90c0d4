"""The ``nodeguard`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nodeguard import __version__
from nodeguard.config import Document, Settings, json_schema, load_document
from nodeguard.errors import ConfigError, ConfigUnreadable, NodeguardError
from nodeguard.log import configure, get_logger, json_mode
from nodeguard.node_identity import node_labels, node_name
from nodeguard.sources.paths import LayoutError
from nodeguard.sources.sensor import Sensor
from nodeguard.surfaces.render import render_snapshot, snapshot_data

EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodeguard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nodeguard {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--config", "-c", type=Path, help="per-node JSON config (default: built-in defaults)")
        sub.add_argument("--node-name", help="this node's name (default: $NODE_NAME or the hostname)")
        sub.add_argument(
            "--node-label",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a label of this node, for perNode rules (repeatable)",
        )

    snap = commands.add_parser("snapshot", help="show node and per-workload usage now")
    with_config(snap)
    snap.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    snap.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS until Ctrl-C")
    snap.add_argument("--interval", type=float, default=1.0, help="seconds between the two reads for rates")

    check = commands.add_parser("check-config", help="validate a config file; exit 1 if invalid, 2 if unreadable")
    check.add_argument("file", type=Path)
    check.add_argument("--node-name", help="also show the settings merged for this node")
    check.add_argument("--node-label", action="append", default=[], metavar="KEY=VALUE")

    commands.add_parser("schema", help="print the config's JSON Schema")

    run = commands.add_parser("run", help="run the daemon (guard, and later gate and coordination)")
    with_config(run)
    run.add_argument("--dry-run", action="store_true", help="log every write and eviction instead of making it")

    plan = commands.add_parser("plan", help="show what the guard would do now, without acting")
    with_config(plan)
    plan.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="METRIC=VALUE",
        help="pretend the node's METRIC is VALUE, e.g. cpu_total_usage=7.5 (repeatable)",
    )
    plan.add_argument("--json", action="store_true", help="the decision trace as one JSON line")
    plan.add_argument("--interval", type=float, default=1.0, help="seconds between the two reads for rates")

    demo = commands.add_parser("demo", help="watch nodeguard throttle burners on this machine (about 30 s)")
    demo.add_argument("--seconds", type=float, default=30.0)

    status = commands.add_parser("status", help="the running daemon's status (reads its /status endpoint)")
    with_config(status)
    status.add_argument("--json", action="store_true", help="the raw /status JSON")

    from nodeguard.gate.client import add_gate_commands

    add_gate_commands(commands)  # gate, admit, oci-hook: each sets its own handler

    restore = commands.add_parser(
        "restore", help="restore quotas recorded in the ledger; works while the daemon is down"
    )
    with_config(restore)
    restore.add_argument("--all", action="store_true", required=True, help="every entry of the ledger")
    restore.add_argument("--ledger", help="ledger file (default: actuation.ledgerPath of the config)")
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    document = load_document(args.config) if args.config else Document()
    labels = node_labels(args.node_name, args.node_label)
    return document.settings_for(labels, str(args.config or "defaults"))


def cmd_snapshot(args: argparse.Namespace) -> int:
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
    from nodeguard.daemon import Daemon
    from nodeguard.kubernetes.nodes import fetch_node_labels_sync, merge_labels
    from nodeguard.surfaces.http import HttpServer
    from nodeguard.surfaces.metrics import Metrics
    from nodeguard.surfaces.status import status_of

    document = load_document(args.config) if args.config else Document()
    name = args.node_name or node_name()
    local = node_labels(name, args.node_label)
    explicit = {pair.partition("=")[0] for pair in args.node_label}
    labels = local
    kube = document.global_.kubernetes
    if kube.enabled and kube.node_labels_from_api:
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
    metrics = Metrics(daemon.view)
    daemon.on_tick.append(metrics.tick_duration.observe)
    daemon.gate.on_admission = metrics.gate_wait.observe
    http = HttpServer(metrics.registry, daemon.health, lambda: status_of(daemon))
    return asyncio.run(daemon.run(serve=http.start))


def cmd_plan(args: argparse.Namespace) -> int:
    from nodeguard.policy.planner import plan
    from nodeguard.policy.state import GuardState
    from nodeguard.policy.trace import plan_to_data
    from nodeguard.policy.whatif import parse_overrides, what_if
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
    result = plan(snapshot, GuardState.primed(), settings.guard)
    if args.json:
        print(json.dumps(plan_to_data(result)))
    else:
        print(render_plan(result))
    return EXIT_OK


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


def cmd_status(args: argparse.Namespace) -> int:
    from nodeguard.surfaces.status_view import fetch_status, show

    listen = load_settings(args).http.listen
    if args.json:
        print(json.dumps(fetch_status(listen)))
    else:
        show(listen)
    return EXIT_OK


def _daemon_logs_json(args: argparse.Namespace) -> bool:
    """The daemon's fatal errors are log events in a JSON log, like everything else it says."""
    return args.command == "run" and json_mode()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure(args.log_level)
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
        if args.command == "schema":
            print(json.dumps(json_schema(), indent=2))
            return EXIT_OK
    except ConfigError as exc:
        if _daemon_logs_json(args):
            get_logger("nodeguard").error("config rejected; not starting", source=exc.source, problems=exc.problems)
        else:
            print(exc.render(), file=sys.stderr)
        return EXIT_INVALID
    except ConfigUnreadable as exc:
        if _daemon_logs_json(args):
            get_logger("nodeguard").error("config unreadable; not starting", error=str(exc))
        else:
            print(exc, file=sys.stderr)
        return EXIT_UNREADABLE
    except (NodeguardError, LayoutError, OSError) as exc:
        if _daemon_logs_json(args):
            get_logger("nodeguard").error("cannot start", error=str(exc))
        else:
            print(f"nodeguard: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")
