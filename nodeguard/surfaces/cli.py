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
from nodeguard.log import configure
from nodeguard.node import node_labels, node_name
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure(args.log_level)
    try:
        if args.command == "snapshot":
            return cmd_snapshot(args)
        if args.command == "check-config":
            return cmd_check_config(args)
        if args.command == "schema":
            print(json.dumps(json_schema(), indent=2))
            return EXIT_OK
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_INVALID
    except ConfigUnreadable as exc:
        print(exc, file=sys.stderr)
        return EXIT_UNREADABLE
    except (NodeguardError, LayoutError, OSError) as exc:
        print(f"nodeguard: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")
