"""The command line as a user runs it: exit codes and output."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cli import nodeguard

REPO = Path(__file__).resolve().parents[1]


def test_check_config_exit_codes(tmp_path: Path) -> None:
    """check-config exits 0 for a valid file, 1 listing every error path, 2 when unreadable."""
    good = nodeguard("check-config", str(REPO / "packaging/examples/host.json"))
    assert good.returncode == 0, good.stderr
    assert "valid" in good.stdout
    bad_file = tmp_path / "bad.json"
    bad_file.write_text(
        json.dumps(
            {
                "global": {"sensing": {"tickSeconds": -1}},
                "perNode": [
                    {
                        "nodeSelector": {},
                        "guard": {
                            "objectives": [
                                {
                                    "metric": "cpu_total_usage",
                                    "threshold": "eighty",
                                    "restoreBelow": "10%",
                                    "action": "throttle",
                                }
                            ]
                        },
                    }
                ],
            }
        )
    )
    bad = nodeguard("check-config", str(bad_file))
    assert bad.returncode == 1
    assert "global.sensing.tickSeconds: " in bad.stderr
    assert (
        'perNode[0].guard.objectives[0].threshold: expected a number of cores or a percentage like "80%", got "eighty"'
        in bad.stderr
    )
    assert "Traceback" not in bad.stderr
    missing = nodeguard("check-config", str(tmp_path / "absent.json"))
    assert missing.returncode == 2 and "cannot read config" in missing.stderr
    not_json = tmp_path / "x.json"
    not_json.write_text("{")
    assert nodeguard("check-config", str(not_json)).returncode == 1


def test_snapshot_json_on_this_host() -> None:
    """snapshot --json prints the node's usage measured over an interval."""
    result = nodeguard("snapshot", "--json", "--interval", "0.3")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    node = data["node"]
    assert node["cpus"] >= 1 and 0 <= node["cpu_utilization"] <= 100
    assert node["memory"]["total"] > 0 and isinstance(data["workloads"], list)


def test_snapshot_table_and_bad_config(tmp_path: Path) -> None:
    """The table view names the node figures; a broken config stops snapshot with exit 1 and no traceback."""
    table = nodeguard("snapshot", "--interval", "0.2")
    assert table.returncode == 0, table.stderr
    assert "cpu" in table.stdout and "workload" in table.stdout
    broken = tmp_path / "broken.json"
    broken.write_text('{"global": {"sensing": {"cgroupRoot": 5}}}')
    result = nodeguard("snapshot", "--config", str(broken))
    assert result.returncode == 1 and "global.sensing.cgroupRoot" in result.stderr
    assert "Traceback" not in result.stderr


COMMANDS = ["snapshot", "check-config", "schema", "run", "plan", "demo", "status", "gate", "admit", "oci-hook",
            "gatectl", "restore", "held"]  # fmt: skip


def test_help_lists_every_command_and_each_command_has_its_options() -> None:
    """--help lists every command (each command's parser is built only when it runs), each command's --help shows
    its own options, and a wrong command or a missing option is refused with argparse's usual message and exit 2."""
    from nodeguard.surfaces.cli import _parser

    top = _parser().format_help()
    for command in COMMANDS:
        assert f"\n    {command} " in top, command
    own = {"snapshot": "--watch", "check-config": "file", "run": "--dry-run", "plan": "--what-if", "demo": "--seconds",
           "status": "--json", "gate": "--keep-on-failure", "admit": "--ready-http", "oci-hook": "--if-unavailable",
           "gatectl": "{status,ready,release,cancel}", "restore": "--ledger", "held": "--json", "schema": "usage: nodeguard schema"}  # fmt: skip
    for command in COMMANDS:
        result = nodeguard(command, "--help")
        assert result.returncode == 0 and own[command] in result.stdout, (command, result.stdout, result.stderr)
    wrong = nodeguard("bogus")
    assert wrong.returncode == 2 and "invalid choice: 'bogus' (choose from 'snapshot'" in wrong.stderr
    missing = nodeguard("admit")
    assert missing.returncode == 2 and "the following arguments are required: --name" in missing.stderr
    assert _parser().parse_args(["admit", "--name", "a", "--after", "b,c"]).after == ["b,c"]
