"""The Dockerfile, checked statically: stages, final image contents, entrypoint, context.

(tests/containers/test_image.py builds it with podman and runs the image.)
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|cc|clang|make|build-essential|python3?-dev|libc6?-dev|apt-get|apk)\b")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments and the parser directive dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    parsed = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        parsed.append((keyword.upper(), args.strip()))
    return parsed


def global_args() -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults (what a plain build uses)."""
    found: dict[str, str] = {}
    for keyword, args in instructions(DOCKERFILE.read_text(encoding="utf-8")):
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = args.partition("=")
            found[name.strip()] = default.strip()
    return found


def stages() -> list[Stage]:
    found: list[Stage] = []
    defaults = global_args()
    for keyword, args in instructions(DOCKERFILE.read_text(encoding="utf-8")):
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], words[0])
            found.append(Stage(base, name))
        elif found:
            found[-1].instructions.append((keyword, args))
        else:
            assert keyword == "ARG", f"{keyword} before the first FROM"
    return found


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copy_sources(args: str) -> tuple[list[str], bool]:
    """The sources of a COPY/ADD and whether they come from another stage (``--from``)."""
    words = args.split()
    from_stage = any(w.startswith("--from") for w in words)
    paths = [w for w in words if not w.startswith("--")]
    return paths[:-1], from_stage


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def in_build_context(relpath: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents decides."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = _pattern_regex(line.lstrip("!").strip("/"))
        if any(pattern.fullmatch(c) for c in candidates):
            included = negated
    return included


def test_build_is_multi_stage_with_named_builder() -> None:
    """There are at least two stages and the final one copies from a named earlier stage."""
    all_stages = stages()
    assert len(all_stages) >= 2
    names = {s.name for s in all_stages[:-1]}
    assert None not in names, "name every build stage (FROM ... AS name)"
    referenced = {
        m
        for args in all_stages[-1].args("RUN") + all_stages[-1].args("COPY")
        for m in re.findall(r"from=([\w.-]+)", args)
    }
    assert referenced and referenced <= names


def test_base_image_is_a_build_arg_with_the_public_default() -> None:
    """Both stages start FROM ${BASE_IMAGE}, an ARG whose default is the public slim Python image."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    froms = [args.split()[0] for keyword, args in instructions(text) if keyword == "FROM"]
    assert froms == ["${BASE_IMAGE}", "${BASE_IMAGE}"], froms
    assert global_args().get("BASE_IMAGE") == "python:3.11-slim"


def test_final_stage_is_slim_python() -> None:
    """Both the builder and the final image start from the same slim Python 3.11+ image."""
    all_stages = stages()
    final = all_stages[-1]
    assert re.fullmatch(r"python:3\.(1[1-9]|[2-9]\d)-slim(-\w+)?", final.base), final.base
    assert all_stages[0].base == final.base, "build the wheels for the interpreter they are installed into"


def test_final_stage_has_no_build_tools_and_no_pip_cache() -> None:
    """The final stage installs no compiler or OS packages, installs only prebuilt wheels, and keeps no pip cache."""
    final = stages()[-1]
    runs = final.args("RUN")
    assert runs, "the final stage installs nothing"
    for run in runs:
        assert not BUILD_TOOLS.search(run), run
        if "pip install" in run:
            assert "--no-cache-dir" in run and "--no-index" in run, run
    for keyword in ("COPY", "ADD"):
        for args in final.args(keyword):
            _, from_stage = copy_sources(args)
            assert from_stage, f"the final stage takes only built artefacts from the builder: {keyword} {args}"


def test_builder_makes_wheels_without_a_cache() -> None:
    """The builder builds wheels of nodeguard and its dependencies with pip wheel and no cache."""
    runs = " ".join(stages()[0].args("RUN"))
    assert re.search(r"pip wheel .*--no-cache-dir", runs), runs
    assert re.search(r"--wheel-dir[ =]/wheels", runs), runs


def test_entrypoint_runs_the_daemon_with_the_default_config() -> None:
    """ENTRYPOINT is `nodeguard run` (the package's console script), CMD the config the DaemonSet mounts."""
    final = stages()[-1]
    (entrypoint,) = final.args("ENTRYPOINT")
    (cmd,) = final.args("CMD")
    assert exec_form(entrypoint) == ["nodeguard", "run"]
    assert exec_form(cmd) == ["--config", "/etc/nodeguard/config.json"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert "nodeguard" in scripts
    daemonset = yaml.safe_load((REPO / "packaging" / "kubernetes" / "daemonset.yaml").read_text(encoding="utf-8"))
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["args"] == exec_form(cmd)


def _copied_sources() -> list[str]:
    sources = []
    for stage in stages():
        for keyword in ("COPY", "ADD"):
            for args in stage.args(keyword):
                paths, from_stage = copy_sources(args)
                if not from_stage:
                    sources += paths
    return sources


@pytest.mark.parametrize("source", _copied_sources())
def test_copied_file_exists_and_is_in_the_build_context(source: str) -> None:
    """Every file or directory the Dockerfile copies from the context exists and is not left out by .dockerignore."""
    path = REPO / source
    assert path.exists(), source
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert files, f"{source} is empty"
    for file in files:
        assert in_build_context(file.relative_to(REPO).as_posix()), f"{file} is excluded by .dockerignore"


def test_pyproject_files_needed_by_the_build_are_copied() -> None:
    """The builder copies pyproject.toml, the readme it names and the package directory hatchling builds."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    needed = {
        "pyproject.toml",
        project["project"]["readme"],
        *project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"],
    }
    copied = {s.rstrip("/") for s in _copied_sources()}
    assert needed <= copied, needed - copied


@pytest.mark.parametrize(
    "heavy",
    [
        ".git/HEAD",
        ".venv/bin/python",
        ".vm/disk.img",
        ".containers/storage/overlay/l/ABC",
        "tests/conftest.py",
        "nodeguard/__pycache__/config.cpython-311.pyc",
    ],
)
def test_dockerignore_keeps_the_rest_out_of_the_context(heavy: str) -> None:
    """The repository's git data, virtualenv, VM images, tests and bytecode are not sent to the builder."""
    assert not in_build_context(heavy)
