"""Real container runtimes for the tests: rootful podman (with runc) and containerd, on state of their own.

Nothing here uses the machine's own podman or containerd state. Images and
containers live in ``<repo>/.containers/`` (kept between runs; every image is
tagged by a hash of its inputs and rebuilt only when they change), the
runtimes' run state under ``/run/nodeguard-tests/<repo key>/`` (a tmpfs, so a
reboot is seen as one). No registry is reachable: every image is built here,
from local files or from Debian's packages.

Two facts of this kind of host shape every container run:

- podman's default limits (RLIMIT_NOFILE and RLIMIT_NPROC up to 1048576) are
  above what runc may set here (no CAP_SYS_RESOURCE), so runc fails ``error
  setting rlimits``: containers run with 1024 of each;
- crun refuses a hybrid cgroup host ("cgroups in hybrid mode not supported"),
  so the runtime is runc, and without systemd as PID 1 the cgroup manager is
  cgroupfs (podman then refuses a ``.slice`` as cgroup parent).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support import cgroups as rc
from tests.support.poll import wait_until

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".containers"
RUN_STATE = Path("/run/nodeguard-tests") / hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
NODEGUARD = Path(sys.executable).with_name("nodeguard")  # the project's own command, in its virtualenv
SHIPPED_HOOK = REPO / "packaging" / "oci-hooks.d" / "nodeguard.json"
BUSYBOX = Path("/bin/busybox")  # busybox-static: runs in an image of its own
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

# Bumped when a recipe below changes what it builds.
BUSYBOX_RECIPE = 1
BASE_RECIPE = 2
BASE_PACKAGES = ("python3-pip",)


def why_no_containers() -> str | None:
    """Why this machine cannot run the real-runtime tests (a missing package is a failure, not a reason)."""
    if sys.platform != "linux":
        return "containers need Linux"
    if os.geteuid() != 0:
        return "rootful podman and containerd need root"
    return None


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: scripts/setup installs it (and every Debian package the tests use)")
    return path


# podman's default limits (up to 1048576) are above what runc may set here: the
# caller has no CAP_SYS_RESOURCE and conmon runs with RLIMIT_NPROC 32768. These
# are below both on any host.
ULIMITS = ("nofile=1024:1024", "nproc=1024:1024")


def ulimit_args() -> list[str]:
    return [arg for limit in ULIMITS for arg in ("--ulimit", limit)]


class CommandFailed(AssertionError):
    def __init__(self, args: Sequence[str], result: subprocess.CompletedProcess[str]) -> None:
        super().__init__(
            f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-4000:]}"
        )
        self.result = result


class Podman:
    """Rootful podman with runc and the cgroupfs manager, on this repository's own storage."""

    def __init__(self, hooks_dir: Path | None = None) -> None:
        self.hooks_dir = hooks_dir

    def with_hooks(self, hooks_dir: Path) -> Podman:
        return Podman(hooks_dir)

    def command(self, *args: str) -> list[str]:
        base = [
            "podman",
            "--root", str(CACHE / "storage"),
            "--runroot", str(RUN_STATE / "podman"),
            "--tmpdir", str(RUN_STATE / "libpod"),
            "--cgroup-manager", "cgroupfs",
            "--runtime", "runc",
            "--events-backend", "file",
        ]  # fmt: skip
        if self.hooks_dir is not None:
            base += ["--hooks-dir", str(self.hooks_dir)]
        return [*base, *args]

    def result(self, *args: str, timeout: float = 120, stdin: int | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout, stdin=stdin)

    def __call__(self, *args: str, timeout: float = 120) -> str:
        """Run a podman command; its stdout, or a failure with its output."""
        result = self.result(*args, timeout=timeout)
        if result.returncode != 0:
            raise CommandFailed(self.command(*args), result)
        return result.stdout.strip()

    def run_args(self, name: str, image: str, command: Sequence[str], options: Sequence[str] = ()) -> list[str]:
        """``podman run -d`` of a container on the host's network, with the caller's limits."""
        return self.command("run", "-d", "--name", name, "--network", "host", *ulimit_args(), *options, image, *command)

    def run(
        self, name: str, image: str, command: Sequence[str], options: Sequence[str] = (), timeout: float = 120
    ) -> str:
        """Start a container and return its id."""
        args = self.run_args(name, image, command, options)
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise CommandFailed(args, result)
        return result.stdout.strip().splitlines()[-1]

    def image_exists(self, tag: str) -> bool:
        return self.result("image", "exists", tag).returncode == 0

    def drop_other_tags(self, repository: str, keep: str) -> None:
        """Untag older builds of an image; untagged images a day old go (younger ones are the build cache)."""
        listed = self("images", "--format", "{{.Repository}}:{{.Tag}}", "--filter", f"reference={repository}")
        for tag in listed.split():
            if tag != keep and tag.startswith(repository + ":"):
                self.result("rmi", tag)
        self.result("image", "prune", "--force", "--filter", "until=24h")

    def remove(self, *names: str) -> None:
        """Remove containers (killed at once), trying again while podman reports a failure."""
        if not names:
            return
        for attempt in range(3):
            result = self.result("rm", "--force", "--time", "0", "--ignore", *names, timeout=60)
            if result.returncode == 0:
                return
            if attempt < 2:
                print(f"podman rm failed, trying again: {result.stderr.strip()}", file=sys.stderr)
                time.sleep(1)  # a pause between retries of a failed command, not a wait on state
        raise CommandFailed(self.command("rm", *names), result)

    def remove_pod(self, name: str) -> None:
        """Remove a pod and its containers (killed at once)."""
        self("pod", "rm", "--force", "--time", "0", "--ignore", name, timeout=60)


def sweep(podman: Podman) -> list[str]:
    """Remove containers and pods left by test sessions that are gone (killed mid-test, a burner may still burn).

    Every test container and pod is named ``ngtest-<pid of its session>-...`` (tests/support/cgroups.unique_name).
    """
    pods = _orphans(podman("pod", "ps", "--format", "{{.Name}}"))
    for pod in pods:
        podman.remove_pod(pod)
    orphans = _orphans(podman("ps", "--all", "--format", "{{.Names}}"))
    podman.remove(*orphans)
    return pods + orphans


def _orphans(listed: str) -> list[str]:
    return [
        name
        for name in listed.split()
        if (match := re.match(r"ngtest-(\d+)-", name)) and not Path(f"/proc/{match.group(1)}").exists()
    ]


def mounts_inside(directory: Path) -> list[str]:
    """What is mounted at or below ``directory`` (/proc/self/mountinfo), deepest first."""
    found = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])  # \040 is a space
        if target == str(directory) or target.startswith(f"{directory}/"):
            found.add(target)
    return sorted(found, key=lambda target: (-target.count("/"), target))


def release_storage(podman: Podman) -> list[str]:
    """At the end of a session: remove its containers still there, then unmount what podman left mounted in this
    checkout, so that the checkout can be deleted; returns what could not be unmounted.

    A running container keeps its layer mounted and, while any layer is, podman keeps its overlay driver's home
    (``.containers/storage/overlay``) bind-mounted after it exits. Nothing is unmounted while podman still lists
    a container (another live session's, or a build's, which is said); the next podman command mounts what it
    needs again.
    """
    ours = [name for name in podman("ps", "--all", "--format", "{{.Names}}").split()
            if name.startswith(f"ngtest-{os.getpid()}-")]  # fmt: skip
    podman.remove(*ours)
    if others := podman("ps", "--all", "--external", "--format", "{{.Names}}").split():
        print(f"\n{CACHE} stays mounted: podman still has containers {' '.join(others)}")
        return []
    for target in mounts_inside(CACHE):
        subprocess.run(["umount", target], capture_output=True, check=False)
    return mounts_inside(CACHE)


def fresh_run_state() -> None:
    """A fresh storage must not meet the run state of an earlier one at the same path (a re-cloned repository)."""
    if (CACHE / "storage").exists() or not RUN_STATE.exists():
        return
    mounts = Path("/proc/self/mounts").read_text()
    if f" {RUN_STATE}/" not in mounts:
        shutil.rmtree(RUN_STATE, ignore_errors=True)


@contextlib.contextmanager
def containers(podman: Podman) -> Iterator[list[str]]:
    """Names of containers a test starts; every one is removed at the end (killed at once)."""
    names: list[str] = []
    try:
        yield names
    finally:
        podman.remove(*names)


# --- cgroups a runtime creates ---------------------------------------------------------


def hierarchies() -> list[Path]:
    """Every cgroup hierarchy mounted under /sys/fs/cgroup (a runtime creates a container's path in each)."""
    root = rc.CGROUP_ROOT
    if (root / "cgroup.procs").exists():
        return [root]
    return sorted(p for p in root.iterdir() if (p / "cgroup.procs").exists())


def remove_everywhere(rel: str) -> None:
    """Remove a cgroup subtree from every hierarchy, once what ran in it is gone."""
    for hierarchy in hierarchies():
        path = hierarchy / rel
        if path.exists():
            rc.remove_cgroup(path)


# --- images -----------------------------------------------------------------------------


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def _import_rootfs(podman: Podman, rootfs: Path, tag: str, changes: Sequence[str]) -> None:
    """``tar -C rootfs -c . | podman import - tag``: an image of a local root file system."""
    tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        change_args = [arg for change in changes for arg in ("--change", change)]
        result = podman.result("import", *change_args, "-", tag, stdin=tar.stdout, timeout=600)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
    if result.returncode != 0 or tar.returncode != 0:
        raise CommandFailed(["podman", "import", tag], result)


def busybox_rootfs() -> Path:
    """A root file system of static busybox and its applets (cached; for ``ctr run --rootfs`` too)."""
    key = _digest(str(BUSYBOX_RECIPE), BUSYBOX.read_bytes())[:16]
    rootfs = CACHE / f"busybox-{key}"
    if (rootfs / "bin" / "busybox").exists():
        return rootfs
    CACHE.mkdir(exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=CACHE, prefix=".busybox-"))
    try:
        building.chmod(0o755)
        for sub in ("bin", "etc", "tmp", "proc", "sys", "dev", "records", "gate"):
            (building / sub).mkdir()
        (building / "tmp").chmod(0o1777)
        shutil.copy2(BUSYBOX, building / "bin" / "busybox")
        applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
        for applet in applets:
            if applet != "busybox":
                (building / "bin" / applet).symlink_to("busybox")
        (building / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        (building / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
        try:
            building.rename(rootfs)
        except OSError:  # another run built it meanwhile
            shutil.rmtree(building)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return rootfs


def busybox_image(podman: Podman) -> str:
    """``localhost/nodeguard-test-busybox:<key>``, imported from :func:`busybox_rootfs`."""
    rootfs = busybox_rootfs()
    tag = f"localhost/nodeguard-test-busybox:{rootfs.name.removeprefix('busybox-')}"
    if not podman.image_exists(tag):
        _import_rootfs(podman, rootfs, tag, ["ENV=PATH=/bin"])
        podman.drop_other_tags("localhost/nodeguard-test-busybox", tag)
    return tag


def os_codename() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "VERSION_CODENAME" and value.strip('"'):
            return value.strip('"')
    pytest.fail("/etc/os-release names no VERSION_CODENAME: the local base image is built with mmdebstrap for it")


def debian_mirror(codename: str) -> str | None:
    """The Debian mirror this machine's apt uses for its own release (None: mmdebstrap's default)."""
    listed = subprocess.run(
        ["apt-get", "indextargets", "--format", "$(SITE) $(RELEASE) $(COMPONENT)", "Created-By: Packages"],
        capture_output=True,
        text=True,
    )
    for line in listed.stdout.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == codename and fields[2] == "main":
            return fields[0]
    return None


def debian_base_image(podman: Podman) -> str:
    """A minimal Debian of this host's release with python3 and pip, made with mmdebstrap: the image's base here.

    It stands in for the public ``python:3.11-slim`` (no registry is reachable):
    like that image, pip installs into ``/usr/local`` (Debian's
    EXTERNALLY-MANAGED marker is removed) and ``python3`` is the command.
    """
    codename = os_codename()
    key = _digest(str(BASE_RECIPE), codename, *BASE_PACKAGES)[:12]
    tag = f"localhost/nodeguard-test-base:{codename}-{key}"
    if podman.image_exists(tag):
        return tag
    require("mmdebstrap")  # debootstrap took 50 s for this image, mmdebstrap 29 s (import included)
    CACHE.mkdir(exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=CACHE, prefix=".base-"))
    log = building.with_suffix(".log")
    try:
        root = building / "root"
        mirror = debian_mirror(codename)
        args = ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", codename, str(root)]
        with log.open("w") as out:
            done = subprocess.run(
                [*args, *([mirror] if mirror else [])], stdout=out, stderr=subprocess.STDOUT, timeout=900
            )
        if done.returncode != 0:
            pytest.fail(f"mmdebstrap failed ({done.returncode}):\n{log.read_text()[-3000:]}")
        for junk in (
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/locale",
        ):
            for child in (root / junk).glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        _import_rootfs(
            podman,
            root,
            tag,
            [
                "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV=LANG=C.UTF-8",
                'CMD=["python3"]',
            ],
        )
        podman.drop_other_tags("localhost/nodeguard-test-base", tag)
    finally:
        shutil.rmtree(building, ignore_errors=True)
        log.unlink(missing_ok=True)
    return tag


def build_context_files() -> list[Path]:
    """The files the Dockerfile's build context holds (.dockerignore lets in only these)."""
    files = [REPO / "Dockerfile", REPO / ".dockerignore", REPO / "pyproject.toml", REPO / "README.md"]
    files += sorted(
        p
        for p in (REPO / "nodeguard").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    return files


def nodeguard_image(podman: Podman, base: str) -> str:
    """nodeguard's image built from the repository's Dockerfile on ``base`` (``--build-arg BASE_IMAGE``)."""
    parts: list[bytes | str] = [base]
    for path in build_context_files():
        parts += [path.relative_to(REPO).as_posix(), path.read_bytes()]
    tag = f"localhost/nodeguard-test:{_digest(*parts)[:16]}"
    if podman.image_exists(tag):
        return tag
    args = [
        "build",
        "--build-arg", f"BASE_IMAGE={base}",
        # pip in the builder reaches the package index the way this machine does: its network, and the CA
        # bundle it trusts (which may hold a CA the base's own bundle lacks).
        "--network", "host",
        "--volume", f"{HOST_CA_BUNDLE}:/etc/ssl/certs/ca-certificates.crt:ro",
        *ulimit_args(),
        "--layers",
        "--tag", tag,
        "--file", str(REPO / "Dockerfile"),
        str(REPO),
    ]  # fmt: skip
    podman(*args, timeout=900)
    podman.drop_other_tags("localhost/nodeguard-test", tag)
    return tag


# --- the OCI hook ------------------------------------------------------------------------


def install_hook(hooks_dir: Path, socket: Path, extra_args: Sequence[str] = (), timeout: int | None = None) -> dict:
    """The shipped hook file in ``hooks_dir``, running this project's nodeguard against ``socket``.

    Only the command's path and the socket change (plus ``extra_args`` and the
    timeout where a test says so); the stages and the annotation it matches are
    the shipped ones. The hook's environment (the runtime gives it none but
    this) puts this checkout first on PYTHONPATH: the virtualenv's command may
    belong to another worktree of the repository.
    """
    hook = json.loads(SHIPPED_HOOK.read_text())
    args = list(hook["hook"]["args"])
    args[args.index("--socket") + 1] = str(socket)
    hook["hook"]["path"] = str(NODEGUARD)
    hook["hook"]["args"] = [*args, *extra_args]
    hook["hook"]["env"] = [f"PYTHONPATH={REPO}"]
    if timeout is not None:
        hook["hook"]["timeout"] = timeout
    hooks_dir.mkdir(parents=True, exist_ok=True)
    (hooks_dir / "nodeguard.json").write_text(json.dumps(hook, indent=2))
    return hook


def kill_hooks(socket: Path) -> None:
    """Kill the hook processes of a test's gate (still waiting for admission when the test ends).

    A container whose hook waits holds podman's lock on it, so it cannot be
    removed until runc create returns; killing its hook makes that fail at once.
    """
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"oci-hook" in args and str(socket).encode() in args:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def wait_for_the_node(root: Path, timeout: float = 180) -> None:
    """Wait until no nodeguard holds the node's lock on ``root`` (the writable hierarchy).

    On a shared machine another test run or a demo may act on the node for a
    while; a daemon started meanwhile refuses to run beside it.
    """
    from nodeguard.actuators.node_lock import NodeBusy, hold_node

    busy: list[NodeBusy] = []

    def free() -> bool:
        try:
            with hold_node(str(root)):
                return True
        except NodeBusy as exc:
            busy[:] = [exc]
            return False

    wait_until(free, timeout, "no other nodeguard acting on the node", interval=0.5, detail=lambda: str(busy[-1]))
