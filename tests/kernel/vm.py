"""Run a command inside a QEMU VM whose kernel has cgroup v2 as the only hierarchy.

The build machines mount the cpu controller on cgroup v1, so real ``cpu.max``
enforcement needs a kernel of its own. This module boots Debian's stock
kernel under QEMU software emulation (TCG) with:

* a tiny initramfs (static busybox, ``/init``, the 9p/overlay modules), built
  here in pure Python and cached under ``<repo>/.vm/``;
* the host's ``/`` shared read-only over 9p, with a tmpfs overlay on top, so
  the guest runs the host's own Python and virtual environment under chroot;
* a second, writable 9p share (the ``out_dir``) that carries the command in
  (``cmd.sh``) and results out; the guest sees it at :data:`GUEST_OUT_DIR`;
* the exit status reported through QEMU's ``isa-debug-exit`` device.

The guest's wall clock is set at boot from the emulated RTC, i.e. the host's
UTC to within a second; the guest's monotonic clock and CPU accounting run at
host speed (clocksource hpet), which is what the cpu.max measurements need.

Debug from a shell: ``.venv/bin/python -m tests.kernel.vm -- cat /proc/cmdline``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import lzma
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".vm"

# Where the writable share is mounted inside the chroot; exported to the
# command as NODEGUARD_VM_OUT.
GUEST_OUT_DIR = "/run/nodeguard-vm"
# Set in the guest's environment: code under test in the VM can tell where it runs.
GUEST_FLAG = "NODEGUARD_IN_VM"
IN_VM = os.environ.get(GUEST_FLAG) == "1"

QEMU = "qemu-system-x86_64"
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
# Roots of the module dependency closure the guest needs: virtio PCI transport,
# 9p over virtio, overlayfs. Their dependencies are resolved from modules.dep,
# so kernels that build some of them in or split them differently still work.
# virtio_blk, ext4 (which mounts ext2 too) and the crc32c driver ext4 needs at mount: a disk image given to
# run_in_vm appears as /dev/vda, a real block device with the guest's own page cache (bench/memory.py's cache
# scenario; tmpfs and 9p would not do).
ROOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_blk", "crc32c_generic", "ext4")

# -M microvm hung one boot in four calibrating the TSC under TCG; pc did not.
MACHINE_ARGS = ("-M", "pc", "-accel", "tcg", "-cpu", "max", "-smp", "2")
DEFAULT_MEMORY_MB = 1024
KERNEL_CMDLINE = "console=ttyS0 quiet panic=-1 cgroup_no_v1=all"

# isa-debug-exit makes QEMU exit with (value << 1) | 1. A kernel panic
# (panic=-1 plus -no-reboot) or a plain poweroff exits with 0 instead.
DEBUG_EXIT_PORT = 0xF4

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_XZ_MAGIC = b"\xfd7zXZ\x00"


class VMError(RuntimeError):
    """The VM did not run the command to completion (boot failure, panic, timeout)."""

    def __init__(self, message: str, console: str) -> None:
        super().__init__(f"{message}\n--- guest console ---\n{console}\n--- end of console ---")
        self.console = console


class VMTimeout(VMError):
    """The VM was killed because it exceeded its time budget."""


@dataclass(frozen=True)
class VMResult:
    exit_code: int
    console: str
    out_dir: Path
    elapsed_s: float


@dataclass(frozen=True)
class _Kernel:
    version: str
    vmlinuz: Path
    modules_dir: Path


# --- finding the ingredients -------------------------------------------------


def _version_key(version: str) -> list[tuple[int, int | str]]:
    # Natural sort so 6.10 > 6.9; tag ints vs strings so mixed parts compare.
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", version) if p]


def _find_kernel() -> _Kernel | str:
    """The newest /boot/vmlinuz-* that has its modules installed, or a reason."""
    images = sorted(
        Path("/boot").glob("vmlinuz-*"),
        key=lambda p: _version_key(p.name.removeprefix("vmlinuz-")),
        reverse=True,
    )
    if not images:
        return "no /boot/vmlinuz-* (install the Debian package linux-image-amd64)"
    for image in images:
        version = image.name.removeprefix("vmlinuz-")
        modules_dir = Path("/lib/modules") / version
        if (modules_dir / "modules.dep").is_file():
            if not os.access(image, os.R_OK):
                return f"{image} is not readable by this user"
            return _Kernel(version, image, modules_dir)
    return f"none of {[str(i) for i in images]} has /lib/modules/<version>/modules.dep"


def _is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a PT_INTERP (dynamic loader) header."""
    try:
        with path.open("rb") as f:
            header = f.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
                return False  # not a 64-bit ELF
            endian = "<" if header[5] == 1 else ">"
            (phoff,) = struct.unpack_from(endian + "Q", header, 0x20)
            phentsize, phnum = struct.unpack_from(endian + "HH", header, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError:
        return False
    pt_interp = 3
    return all(struct.unpack_from(endian + "I", table, i * phentsize)[0] != pt_interp for i in range(phnum))


def _find_busybox() -> Path | str:
    candidates = [*BUSYBOX_CANDIDATES]
    if found := shutil.which("busybox"):
        candidates.append(found)
    for candidate in candidates:
        path = Path(candidate)
        if path.is_file() and _is_static_elf(path):
            return path
    return "no statically linked busybox (install the Debian package busybox-static)"


def _read_modules_dep(modules_dir: Path) -> dict[str, tuple[str, list[str]]]:
    """Module name -> (relative path, relative paths of its dependencies)."""
    deps: dict[str, tuple[str, list[str]]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        target, sep, rest = line.partition(":")
        if sep:
            deps[_module_name(target)] = (target, rest.split())
    return deps


def _module_name(path: str) -> str:
    name = path.rsplit("/", 1)[-1].split(".ko", 1)[0]
    return name.replace("-", "_")


def _module_load_order(modules_dir: Path) -> list[str] | str:
    """Relative paths of the modules to insmod, dependencies first, or a reason."""
    deps = _read_modules_dep(modules_dir)
    builtin_file = modules_dir / "modules.builtin"
    builtin = {_module_name(line) for line in builtin_file.read_text().split()} if builtin_file.is_file() else set()
    by_path = {path: name for name, (path, _) in deps.items()}
    order: list[str] = []

    def visit(name: str) -> str | None:
        if name not in deps:
            return None if name in builtin else f"kernel module {name} not found"
        path, requires = deps[name]
        if path in order:
            return None
        for dependency in requires:
            if problem := visit(by_path.get(dependency, _module_name(dependency))):
                return problem
        order.append(path)
        return None

    for root in ROOT_MODULES:
        if problem := visit(root):
            return f"{problem} in {modules_dir}"
    for path in order:
        if not path.endswith((".ko", ".ko.xz", ".ko.gz")):
            return f"cannot decompress {modules_dir / path} (only .ko, .ko.xz, .ko.gz)"
    return order


def _ingredients() -> tuple[_Kernel, Path, list[str]] | str:
    """Kernel, static busybox and module load order, or why they are missing."""
    if sys.platform != "linux":
        return "the kernel VM needs a Linux host"
    if shutil.which(QEMU) is None:
        return f"{QEMU} not found (install the Debian package qemu-system-x86)"
    kernel = _find_kernel()
    if isinstance(kernel, str):
        return kernel
    busybox = _find_busybox()
    if isinstance(busybox, str):
        return busybox
    modules = _module_load_order(kernel.modules_dir)
    if isinstance(modules, str):
        return modules
    return kernel, busybox, modules


def vm_available() -> str | None:
    """None when a kernel VM can be started here, otherwise the reason it cannot."""
    found = _ingredients()
    return found if isinstance(found, str) else None


# --- building the boot artefacts ---------------------------------------------


def _write_atomically(path: Path, data: bytes) -> None:
    # Concurrent test runs may build the same artefact; rename is atomic.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _extract_vmlinux(bzimage: bytes) -> bytes | None:
    """The ELF vmlinux inside a bzImage's XZ payload, or None if there is none."""
    start = bzimage.find(_XZ_MAGIC)
    while start != -1:
        try:
            # The decompressor stops at the end of the stream, ignoring the
            # bzImage's trailing data.
            data = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[start:])
        except lzma.LZMAError:
            data = b""
        if data.startswith(b"\x7fELF"):
            return data
        start = bzimage.find(_XZ_MAGIC, start + 1)
    return None


def _boot_kernel(kernel: _Kernel) -> Path:
    """A cached, decompressed vmlinux (saves ~5 s of emulated decompression).

    Falls back to the compressed image when it carries no XZ stream.
    """
    stat = kernel.vmlinuz.stat()
    stamp = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cached = CACHE_DIR / kernel.version / f"vmlinux-{stamp}"
    if cached.is_file():
        return cached
    vmlinux = _extract_vmlinux(kernel.vmlinuz.read_bytes())
    if vmlinux is None:
        return kernel.vmlinuz
    _write_atomically(cached, vmlinux)
    return cached


def _cpio_newc(entries: Iterable[tuple[str, int, bytes, int]]) -> bytes:
    """A cpio "newc" archive from (name, mode, data, rdev) entries, as the kernel reads it."""
    out = bytearray()

    def add(ino: int, name: str, mode: int, data: bytes, rdev: int) -> None:
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev >> 8, rdev & 0xFF)
        out.extend(b"070701" + b"".join(b"%08X" % v for v in fields))
        out.extend(b"%08X%08X" % (len(encoded), 0))
        out.extend(encoded)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    count = 0
    for count, (name, mode, data, rdev) in enumerate(entries, start=1):
        add(count, name, mode, data, rdev)
    add(count + 1, "TRAILER!!!", 0, b"", 0)
    return bytes(out)


def _init_script(module_files: list[str]) -> str:
    insmods = "\n".join(f"insmod /modules/{name} || fail 'insmod {name}'" for name in module_files)
    return f"""#!/bin/busybox sh
# PID 1 of the nodeguard test VM; generated by tests/kernel/vm.py.
/bin/busybox --install -s /bin
export PATH=/bin

# Without an exit_code file and with QEMU exiting 0, the host reports a failed boot.
fail() {{
    echo "nodeguard-vm: init failed: $*"
    poweroff -f
}}

mount -t proc proc /proc || fail 'mount /proc'
mount -t sysfs sysfs /sys || fail 'mount /sys'
mount -t devtmpfs devtmpfs /dev || fail 'mount /dev'
{insmods}

mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /lower \\
    || fail 'mount host root'
mount -t tmpfs -o mode=0755 tmpfs /rw || fail 'mount tmpfs'
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \\
    || fail 'mount overlay'

R=/newroot
mount -t proc proc $R/proc || fail 'mount chroot /proc'
mount -t sysfs sysfs $R/sys || fail 'mount chroot /sys'
mount -t cgroup2 -o nsdelegate cgroup2 $R/sys/fs/cgroup || fail 'mount cgroup2'
mount -t devtmpfs devtmpfs $R/dev || fail 'mount chroot /dev'
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm
mount -t tmpfs -o mode=0755 tmpfs $R/run || fail 'mount chroot /run'
# No tmpfs on /tmp: the checkout or the venv may live there (CI); the
# overlay already makes it writable without touching the host.
mkdir -p $R{GUEST_OUT_DIR}
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 nodeguardout $R{GUEST_OUT_DIR} \\
    || fail 'mount out share'

# Let tests create child groups with every controller (cpu.max needs +cpu).
for c in $(cat $R/sys/fs/cgroup/cgroup.controllers); do
    echo "+$c" > $R/sys/fs/cgroup/cgroup.subtree_control \\
        || echo "nodeguard-vm: cannot enable controller $c"
done
ip link set lo up
hostname nodeguard-vm

env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    chroot $R /bin/sh {GUEST_OUT_DIR}/cmd.sh </dev/null >/dev/console 2>&1
rc=$?
echo $rc > $R{GUEST_OUT_DIR}/exit_code
sync
printf "\\\\$(printf %o $((rc & 127)))" | dd of=/dev/port bs=1 seek={DEBUG_EXIT_PORT} count=1 \\
    2>/dev/null
poweroff -f
"""


def _read_module(path: Path) -> bytes:
    if path.name.endswith(".xz"):
        return lzma.decompress(path.read_bytes())
    if path.name.endswith(".gz"):
        return gzip.decompress(path.read_bytes())
    return path.read_bytes()


def _initramfs(kernel: _Kernel, busybox: Path, module_paths: list[str]) -> Path:
    """A cached initramfs with busybox, /init and the (decompressed) modules."""
    module_files = [p.rsplit("/", 1)[-1].split(".ko", 1)[0] + ".ko" for p in module_paths]
    init = _init_script(module_files)
    bb_stat = busybox.stat()
    key = hashlib.sha256(
        "\0".join([init, *module_paths, str(bb_stat.st_size), str(bb_stat.st_mtime_ns)]).encode()
    ).hexdigest()[:16]
    cached = CACHE_DIR / kernel.version / f"initramfs-{key}.cpio"
    if cached.is_file():
        return cached
    directory, executable, regular, chardev = 0o040755, 0o100755, 0o100644, 0o020600
    entries: list[tuple[str, int, bytes, int]] = [
        (name, directory, b"", 0) for name in ("bin", "dev", "proc", "sys", "lower", "rw", "newroot", "modules")
    ]
    entries += [
        ("dev/console", chardev, b"", (5 << 8) | 1),
        ("bin/busybox", executable, busybox.read_bytes(), 0),
        ("init", executable, init.encode(), 0),
    ]
    entries += [
        (f"modules/{name}", regular, _read_module(kernel.modules_dir / path), 0)
        for name, path in zip(module_files, module_paths, strict=True)
    ]
    _write_atomically(cached, _cpio_newc(entries))
    return cached


# --- running -----------------------------------------------------------------


def _command_script(argv: list[str], cwd: str, env: Mapping[str, str]) -> str:
    lines = ["# Generated by tests/kernel/vm.py; run by the guest's init under chroot."]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    complaint = shlex.quote(f"nodeguard-vm: cannot cd to {cwd}")
    lines.append(f"cd {shlex.quote(cwd)} || {{ echo {complaint}; exit 126; }}")
    lines.append("exec " + shlex.join(argv))
    return "\n".join(lines) + "\n"


def _guest_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        GUEST_FLAG: "1",
        "NODEGUARD_VM_OUT": GUEST_OUT_DIR,
    }
    env.update(extra or {})
    for name in env:
        if not _ENV_NAME.match(name):
            raise ValueError(f"invalid environment variable name {name!r}")
    return env


def _pump(source: IO[bytes], sink: bytearray, echo: IO[bytes] | None) -> None:
    # Read as it comes so a full pipe never blocks the guest, and so the console
    # so far is available on timeout.
    while chunk := os.read(source.fileno(), 65536):
        sink.extend(chunk)
        if echo is not None:
            echo.write(chunk)
            echo.flush()


def run_in_vm(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    out_dir: Path | None = None,
    memory_mb: int = DEFAULT_MEMORY_MB,
    echo: IO[bytes] | None = None,
    disk: Path | None = None,
) -> VMResult:
    """Run ``argv`` as root in a fresh VM with a pure cgroup v2 kernel; return its status.

    ``env`` adds to (or overrides) a minimal environment that already holds
    PATH, HOME, ``NODEGUARD_IN_VM=1`` and ``NODEGUARD_VM_OUT``. ``out_dir`` is
    the host side of the writable share (a new temporary directory when
    omitted; the caller removes it). ``echo`` receives the console live.
    Raises VMError when the guest does not finish the command, VMTimeout when
    it runs past ``timeout`` seconds. ``disk``: a raw image the guest sees as
    /dev/vda (virtio-blk).
    """
    if not argv:
        raise ValueError("argv must not be empty")
    found = _ingredients()
    if isinstance(found, str):
        raise VMError(f"cannot start the VM: {found}", "")
    kernel, busybox, modules = found
    vmlinux = _boot_kernel(kernel)
    initramfs = _initramfs(kernel, busybox, modules)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="nodeguard-vm-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "exit_code").unlink(missing_ok=True)
    # The guest sees the host's tree at the same paths, so only make it absolute.
    (out / "cmd.sh").write_text(_command_script(argv, os.path.abspath(cwd), _guest_env(env)))

    qemu_argv = [
        QEMU,
        *MACHINE_ARGS,
        "-m", str(memory_mb),
        "-display", "none", "-no-reboot", "-nodefaults", "-serial", "stdio",
        "-kernel", str(vmlinux),
        "-initrd", str(initramfs),
        "-append", KERNEL_CMDLINE,
        "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        "-fsdev", f"local,id=out,path={_qemu_escape(out)},security_model=none,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=out,mount_tag=nodeguardout",
        "-device", f"isa-debug-exit,iobase={DEBUG_EXIT_PORT:#x},iosize=0x04",
    ]  # fmt: skip
    if disk is not None:
        qemu_argv += ["-drive", f"file={_qemu_escape(Path(disk))},format=raw,if=virtio"]
    console_bytes = bytearray()
    started = time.monotonic()
    with tempfile.TemporaryFile() as qemu_stderr:
        proc = subprocess.Popen(qemu_argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=qemu_stderr)
        assert proc.stdout is not None
        reader = threading.Thread(target=_pump, args=(proc.stdout, console_bytes, echo), daemon=True)
        reader.start()
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(5)  # drain what the guest printed before the kill
            raise VMTimeout(
                f"VM killed after {timeout:g} s running {shlex.join(argv)}",
                _console_text(console_bytes),
            ) from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            reader.join(5)
            proc.stdout.close()
        qemu_stderr.seek(0)
        stderr_text = qemu_stderr.read().decode(errors="replace").strip()
    elapsed = time.monotonic() - started
    console = _console_text(console_bytes)

    exit_file = out / "exit_code"
    if not exit_file.is_file():
        detail = f"QEMU exit status {status}"
        if status == 0:
            detail += " (guest init failed or the kernel panicked; see the console)"
        if stderr_text:
            detail += f"; QEMU stderr: {stderr_text}"
        raise VMError(f"the VM did not run {shlex.join(argv)}: {detail}", console)
    exit_code = int(exit_file.read_text())
    # The file holds the full status (debug-exit carries 7 bits); cross-check
    # that init itself reported it, not a command that wrote such a file.
    if status != (((exit_code & 127) << 1) | 1):
        raise VMError(
            f"QEMU exit status {status} does not match the guest's exit code {exit_code}"
            + (f"; QEMU stderr: {stderr_text}" if stderr_text else ""),
            console,
        )
    return VMResult(exit_code, console, out, elapsed)


def _qemu_escape(path: Path) -> str:
    # QEMU option values escape a literal comma by doubling it.
    return str(path).replace(",", ",,")


def _console_text(raw: bytes | bytearray) -> str:
    return bytes(raw).decode(errors="replace").replace("\r\n", "\n")


def main(args: list[str] | None = None) -> int:
    """``python -m tests.kernel.vm [--cwd DIR] [--timeout S] -- CMD...``: run CMD in the VM."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.kernel.vm",
        description="Run a command in the nodeguard cgroup v2 test VM, console on stdout.",
    )
    parser.add_argument("--cwd", default=os.getcwd(), help="directory to run in (host path)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before killing the VM")
    parser.add_argument("--out-dir", type=Path, help="host directory shared writable with the VM")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    ns = parser.parse_args(args)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no command given")
    try:
        result = run_in_vm(command, cwd=ns.cwd, timeout=ns.timeout, out_dir=ns.out_dir, echo=sys.stdout.buffer)
    except VMError as error:
        print(f"nodeguard-vm: {str(error).splitlines()[0]}", file=sys.stderr)
        return 125
    print(
        f"nodeguard-vm: exit code {result.exit_code} after {result.elapsed_s:.1f} s; out dir {result.out_dir}",
        file=sys.stderr,
    )
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
