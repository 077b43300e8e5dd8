"""Whether an environment image can run what the node brings into it, read from its unpacked
root without running anything of it.

A harness CLI (claude, codex, gemini, qwen, pi) runs on the node's Node.js, bound into the
image's sandbox: a binary linked against the node's libc, which the image has to provide.
`missing` reads the binary's ELF headers (its interpreter, the libraries it links against and
the symbol versions it asks of them) and looks for each in the image's root as a process
chrooted there would find it: links followed inside the root, never out of it. An image
without them (busybox, musl/Alpine, distroless, an older glibc) still runs `command` tasks,
and a harness task on it is refused with what is missing: at submission where the image is
unpacked on that machine (`check_task`), else at the node's INIT (a set-up failure, not the
policy's).
"""

from __future__ import annotations

import functools
import mmap
import os
import platform
import shutil
import stat
import struct
from pathlib import Path

from . import harnesses, images

PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
DT_NEEDED, DT_STRTAB, DT_RPATH, DT_RUNPATH, DT_VERNEED, DT_VERNEEDNUM = 1, 5, 15, 29, 0x6FFFFFFE, 0x6FFFFFFF
MAX_HOPS = 40                   # links followed in one lookup, as the kernel allows


def _triplet() -> str:
    machine = platform.machine()
    return {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine, f"{machine}-linux-gnu")


def library_dirs() -> tuple[str, ...]:
    """Where a glibc loader looks for a library without its cache: the multiarch directories
    (Debian, Ubuntu), lib64 (Fedora, RHEL), then lib."""
    t = _triplet()
    return (f"/lib/{t}", f"/usr/lib/{t}", "/lib64", "/usr/lib64", "/lib", "/usr/lib", "/usr/local/lib")


def resolve_in(root: Path, path: str) -> Path | None:
    """path as a process chrooted at root finds it: every link followed inside root (an
    absolute target from root, `..` never above it), none out of it; None where it is not
    there, loops, or is not a regular file."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(root, *done, name)
        try:
            st = os.lstat(here)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_HOPS:
                return None
            try:
                target = os.readlink(here)
            except OSError:
                return None
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
        elif parts and not stat.S_ISDIR(st.st_mode):
            return None
        else:
            done.append(name)
    found = Path(root, *done)
    try:
        return found if stat.S_ISREG(os.lstat(found).st_mode) else None
    except OSError:
        return None


class ElfNeeds:
    """What a dynamically linked ELF binary needs of the system it runs on."""

    def __init__(self, interp: str | None, needed: list[str], versions: dict[str, list[str]],
                 runpath: list[str] | None = None):
        self.interp = interp            # its ELF interpreter (PT_INTERP); None: static
        self.needed = needed            # DT_NEEDED, in order
        self.versions = versions        # library -> the symbol versions it asks of it (GLIBC_2.34, ...)
        self.runpath = runpath or []    # DT_RUNPATH/DT_RPATH, $ORIGIN as written


def elf_needs(path: str) -> ElfNeeds | None:
    """The needs of a 64-bit little-endian ELF binary (the machines this runs on); None for
    anything else (a script, another class), which is not checked."""
    with open(path, "rb") as f:
        if f.read(6) != b"\x7fELF\x02\x01":
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse(m)


def _parse(m: mmap.mmap) -> ElfNeeds:
    phoff, = struct.unpack_from("<Q", m, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", m, 0x36)
    loads, interp, dynamic = [], None, None
    for i in range(phnum):
        p_type, _, off, vaddr, _, filesz, _, _ = struct.unpack_from("<IIQQQQQQ", m, phoff + i * phentsize)
        if p_type == PT_LOAD:
            loads.append((vaddr, off, filesz))
        elif p_type == PT_INTERP:
            interp = m[off:off + filesz].split(b"\0", 1)[0].decode(errors="replace")
        elif p_type == PT_DYNAMIC:
            dynamic = (off, filesz)
    if dynamic is None:
        return ElfNeeds(interp, [], {})

    def at(vaddr: int) -> int:      # a virtual address as an offset in the file
        for start, off, size in loads:
            if start <= vaddr < start + size:
                return off + vaddr - start
        raise ValueError(f"address {vaddr:#x} is in no loaded segment")

    def string(off: int) -> str:
        return m[off:m.find(b"\0", off)].decode(errors="replace")

    tags: dict[int, list[int]] = {}
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", m, off)
        if tag == 0:
            break
        tags.setdefault(tag, []).append(val)
    strtab = at(tags[DT_STRTAB][0])
    needed = [string(strtab + v) for v in tags.get(DT_NEEDED, [])]
    runpath = [d for v in tags.get(DT_RUNPATH, []) + tags.get(DT_RPATH, []) for d in string(strtab + v).split(":") if d]
    versions: dict[str, list[str]] = {}
    if DT_VERNEED in tags:
        off = at(tags[DT_VERNEED][0])
        for _ in range(tags.get(DT_VERNEEDNUM, [0])[0]):
            _, cnt, file, aux, nxt = struct.unpack_from("<HHIII", m, off)
            lib, a = string(strtab + file), off + aux
            for _ in range(cnt):
                _, _, _, name, anext = struct.unpack_from("<IHHII", m, a)
                versions.setdefault(lib, []).append(string(strtab + name))
                a += anext
            off += nxt
            if not nxt:
                break
    return ElfNeeds(interp, needed, versions, runpath)


def _defines(lib: Path, version: str) -> bool:
    """Whether the library names the symbol version (in its string table: a glibc defines
    GLIBC_2.34 only from 2.34 on)."""
    try:
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(b"\0" + version.encode() + b"\0") >= 0
    except (OSError, ValueError):
        return False


def missing(rootfs: Path, exe: str) -> list[str]:
    """What the node's binary exe lacks in the image at rootfs to run there: its interpreter,
    its libraries, the newest symbol version of a library that the image's is too old for.
    [] where it runs (or is not an ELF binary this reads)."""
    try:
        needs = elf_needs(exe)
    except (OSError, ValueError, struct.error):
        return []
    if needs is None:
        return []
    out = []
    if needs.interp and resolve_in(rootfs, needs.interp) is None:
        out.append(f"{needs.interp} (its ELF interpreter)")
    # its own libraries (its RUNPATH outside the system's directories: a pyenv Python's
    # libpython) come with it: the sandbox binds its prefix
    origin = os.path.dirname(exe)
    own = [d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin) for d in needs.runpath]
    own = [d for d in own if os.path.normpath(d) not in library_dirs()]
    for lib in needs.needed:
        if any(os.path.isfile(os.path.join(d, lib)) for d in own):
            continue
        found = next((p for d in library_dirs() if (p := resolve_in(rootfs, f"{d}/{lib}")) is not None), None)
        if found is None:
            out.append(lib)
            continue
        old = [v for v in needs.versions.get(lib, []) if not _defines(found, v)]
        if old:
            newest = max(old, key=lambda v: [int(x) if x.isdigit() else 0 for x in v.replace("_", ".").split(".")])
            out.append(f"{newest} in {lib} (the image's is older)")
    return out


def _shebang(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            line = f.readline(256)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    words = line[2:].split()
    return words[0].decode(errors="replace") if words else None


def harness_unfit(rootfs: Path, harness: str) -> str | None:
    """Why the image at rootfs cannot run the harness, or None where it can (or the harness
    brings nothing: `command`). Asked once per image, harness and Node.js binary."""
    h = harnesses.HARNESSES.get(harness)
    if h is None or h.package is None:
        return None
    node = shutil.which("node")
    if node is None:
        return None     # no Node.js on this node: the harness fails to start wherever it runs, saying so
    node = os.path.realpath(node)
    try:
        version = os.stat(node).st_mtime_ns
    except OSError:
        return None
    return _harness_unfit(str(rootfs), harness, node, version)


@functools.lru_cache(maxsize=256)
def _harness_unfit(rootfs_path: str, harness: str, node: str, node_version: int) -> str | None:
    rootfs, h = Path(rootfs_path), harnesses.HARNESSES[harness]
    assert h.package is not None
    lacks = missing(rootfs, node)
    # the CLI is a script that finds node through its #! line (`/usr/bin/env node`): that
    # interpreter is the image's
    exe = harnesses.install_dir(harness) / "node_modules" / ".bin" / h.package.bin
    interp = _shebang(exe) if exe.exists() else "/usr/bin/env"
    if interp and not interp.startswith("/run/polar/") and resolve_in(rootfs, interp) is None:
        lacks.append(f"{interp} (the #! interpreter of {h.package.bin})")
    if not lacks:
        return None
    return (f"the image cannot run the {harness} harness: Node.js ({node}, the node's, linked against its "
            f"libc) needs what the image lacks: {', '.join(lacks)}. Use an image with glibc and libstdc++ "
            f"(Debian, Ubuntu, RHEL), or the command harness")


def python_unfit(rootfs: Path, python: str) -> str | None:
    """Why the node's Python cannot run in the image (the proxy bridge, where the node runs it
    inside), or None."""
    lacks = missing(rootfs, python)
    if not lacks:
        return None
    return (f"the image cannot run this node's proxy bridge: the node cannot make a session's network "
            f"namespace itself (it needs root), and its Python ({python}) needs what the image lacks: "
            f"{', '.join(lacks)}")


def check_task(task) -> str | None:
    """Why the task's harness cannot run in its image, where this machine holds the image
    unpacked; None where it can, or where that is not known here (the node's INIT checks)."""
    if task.runtime is None or harnesses.HARNESSES.get(task.harness, None) is None:
        return None
    if harnesses.HARNESSES[task.harness].package is None:
        return None
    rootfs = images.unpacked_here(task.runtime.image)
    return harness_unfit(rootfs, task.harness) if rootfs is not None else None
