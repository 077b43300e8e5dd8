"""Files shipped with a task, for nodes on other machines: every local path a task names (its
workspace directory, a git repository on this machine, a local image, each prepare or
eval_prepare copy) is packed by the rollout server (RolloutServer(ship_files=True)) into a
content-addressed tar, its blob, that nodes fetch (GET /files/{sha256}) and cache
(files_cache.py). The task records which path is which blob (TaskRequest.files: path as the
task names it -> sha256); a node rewrites those paths to its cached copies (localized), so it
never reads the submitter's disk.

A blob is a deterministic tar of one path under one top entry, CONTENT (the path itself: a
directory or a file): members sorted, owners 0, mtimes 0, permission bits kept (setuid,
setgid and sticky dropped), every file written as a regular file (hard links too), symlinks
kept as symlinks and never followed. A link that resolves out of the tree (absolute, or
through ".." past its top, through other links too: link_escapes) is refused at packing, as
the node refuses it at unpacking. Its name is the sha256 of its bytes: the same content packed
twice is one blob.

BlobStore keeps them in a folder of the server's (next to its database: DB.files/), written
while hashed (never held in memory), and remembers each path's stat fingerprint (names,
sizes, modes, mtimes, ctimes, inodes): an unchanged tree is not read again, only walked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import stat
import tarfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Mapping

from . import images
from .spec import Action, TaskError, TaskRequest, _remote

CONTENT = "content"                     # the top entry of every blob: the shipped path itself
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_LINK_DEPTH = 40                     # links resolved through links, as the kernel's ELOOP
CHUNK = 1 << 20


class ShipError(ValueError):
    """A path that cannot be shipped (missing, a socket or device inside, a link out of it)."""


# -- links inside a tree ---------------------------------------------------------------------------
def link_escapes(links: Mapping[str, str], name: str) -> bool:
    """Whether the symlink `name` ('/'-separated, under CONTENT) resolves out of CONTENT in a
    tree whose symlinks are `links` (name -> target): an absolute target, ".." past the top,
    or a link on the way that does. Resolved by name, as the kernel would, links inside
    followed (up to MAX_LINK_DEPTH); a target that does not exist inside is no escape."""
    return _resolve(links, name.split("/")[:-1], links[name], 0) is None


def _resolve(links: Mapping[str, str], at: list[str], target: str, depth: int) -> list[str] | None:
    if target.startswith("/") or depth > MAX_LINK_DEPTH:
        return None
    at = list(at)
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if len(at) <= 1:        # above CONTENT
                return None
            at.pop()
            continue
        at.append(part)
        inner = links.get("/".join(at))
        if inner is not None:
            resolved = _resolve(links, at[:-1], inner, depth + 1)
            if resolved is None:
                return None
            at = resolved
    return at


# -- packing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    name: str                   # in the tar: CONTENT[/...]
    path: str                   # on this machine
    kind: str                   # dir, file, link
    mode: int                   # permission bits only
    size: int
    target: str | None          # a link's
    stamp: tuple[int, ...]      # what tells a changed file: mtime, ctime, inode, device


def _walk(top: str) -> list[_Entry]:
    """The tree at top (top itself followed if a link: the task named it), sorted, parents
    first; inside it links are never followed. ShipError for anything but files,
    directories and links that stay inside."""
    out: list[_Entry] = []

    def add(name: str, path: str, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode) & 0o777
        stamp = (st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        if stat.S_ISLNK(st.st_mode):
            out.append(_Entry(name, path, "link", 0o777, 0, os.readlink(path), stamp))
        elif stat.S_ISREG(st.st_mode):
            out.append(_Entry(name, path, "file", mode, st.st_size, None, stamp))
        elif stat.S_ISDIR(st.st_mode):
            out.append(_Entry(name, path, "dir", mode, 0, None, stamp))
            with os.scandir(path) as it:
                children = sorted(e.name for e in it)
            for child in children:
                p = os.path.join(path, child)
                add(f"{name}/{child}", p, os.lstat(p))
        else:
            raise ShipError(f"{path} is neither a file, a directory nor a link (a socket, a fifo or a device): "
                            "only those are shipped")

    try:
        add(CONTENT, top, os.stat(top))
    except FileNotFoundError:
        raise ShipError(f"{top}: no such file or directory") from None
    except OSError as e:
        raise ShipError(f"{top}: {e.strerror or e}") from None
    links = {e.name: e.target for e in out if e.kind == "link" and e.target is not None}
    for name, target in links.items():
        if link_escapes(links, name):
            rel = name.removeprefix(CONTENT + "/")
            raise ShipError(f"{top}: the link {rel} -> {target} points out of it; shipped files keep their links "
                            "inside (a node refuses a link out of a shipped tree)")
    return out


def _fingerprint(entries: list[_Entry]) -> str:
    h = hashlib.sha256()
    for e in entries:
        h.update(repr((e.name, e.kind, e.mode, e.size, e.target, e.stamp)).encode("utf-8", "surrogateescape"))
    return h.hexdigest()


class _Hashing:
    """A write-only file that hashes what goes through it (tarfile's stream mode writes here)."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)


def _info(e: _Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(e.name)
    info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", e.mode
    if e.kind == "dir":
        info.type = tarfile.DIRTYPE
    elif e.kind == "link":
        info.type, info.linkname = tarfile.SYMTYPE, e.target or ""
    else:
        info.type, info.size = tarfile.REGTYPE, e.size
    return info


def write_tar(entries: list[_Entry], out: BinaryIO) -> str:
    """The blob of entries, streamed to out; its sha256."""
    hashing = _Hashing(out)
    with tarfile.open(fileobj=hashing, mode="w|", format=tarfile.PAX_FORMAT) as tar:   # type: ignore[call-overload]
        for e in entries:
            info = _info(e)
            if e.kind != "file":
                tar.addfile(info)
                continue
            # by its descriptor, not following a link put in its place since the walk
            fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if os.fstat(f.fileno()).st_size != e.size:
                    raise ShipError(f"{e.path} changed while it was packed")
                tar.addfile(info, f)
    return hashing.sha.hexdigest()


class BlobStore:
    """The server's blobs: ROOT/<sha256>.tar, written as .tmp-* and renamed once complete."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], str] = {}    # (real path, fingerprint) -> sha256
        self.packed = 0                                 # tars written (the others were known)

    def path_of(self, sha256: str) -> Path | None:
        """The blob's file, if this store packed it; a name that is not a sha256 never is."""
        if not isinstance(sha256, str) or not SHA256.fullmatch(sha256):
            return None
        p = self.root / f"{sha256}.tar"
        return p if p.is_file() else None

    def pack(self, path: str) -> str:
        """path (a directory or a file) as a blob: its sha256. A tree unchanged since it was
        last packed (its fingerprint) is walked, not read again."""
        real = os.path.realpath(os.path.expanduser(path))
        entries = _walk(real)
        key = (real, _fingerprint(entries))
        with self._lock:
            known = self._known.get(key)
        if known is not None and self.path_of(known) is not None:
            return known
        tmp = self.root / f".tmp-{uuid.uuid4().hex}.tar"
        try:
            with open(tmp, "xb") as f:
                sha = write_tar(entries, f)
            final = self.root / f"{sha}.tar"
            if final.is_file():
                tmp.unlink()     # the same bytes: keep the one a GET may be reading
            else:
                os.replace(tmp, final)
        except OSError as e:
            raise ShipError(f"{path}: packing it failed: {e}") from None
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._known[key] = sha
            self.packed += 1
        return sha


# -- which paths of a task -------------------------------------------------------------------------
def image_file(ref: str) -> tuple[str, str, str]:
    """A local image reference split as (transport, path, rest): "oci:/x:tag" ->
    ("oci:", "/x", ":tag"); a bare path -> ("", ref, ""). Pure: the node splits a ref the
    same way, without its file."""
    for t in images.FILE_TRANSPORTS:
        if ref.startswith(t):
            path, sep, rest = ref[len(t):].partition(":")
            return t, path, sep + rest
    return "", ref, ""


def _actions(task: TaskRequest) -> tuple[Action, ...]:
    rt = task.runtime
    return (*rt.prepare, *rt.eval_prepare) if rt is not None else ()


def local_paths(task: TaskRequest) -> dict[str, str]:
    """What the task names on this machine, to ship: {the path as the task names it: the path
    here}. A remote git URL and a registry image are the node's to fetch, as before."""
    out: dict[str, str] = {}
    ws = task.workspace
    if ws.path:
        out[ws.path] = ws.path
    if ws.git and not _remote(ws.git):
        out[ws.git] = ws.git.removeprefix("file://")
    rt = task.runtime
    if rt is not None and rt.image != images.TEST_IMAGE:   # the test image: built on each node
        try:
            src = images.transport(rt.image)
        except images.ImageError as e:
            raise TaskError(f"{task.task_id}: runtime.image: {e}") from None
        if src.startswith(images.FILE_TRANSPORTS):
            _, key, _ = image_file(rt.image)
            out[key] = os.path.expanduser(key)
    for a in _actions(task):
        if a.copy is not None:
            out[a.copy] = a.copy
    return out


def ship(task: TaskRequest, store: BlobStore) -> TaskRequest:
    """The task with its files packed into store (TaskRequest.files); TaskError naming the
    path that cannot be shipped."""
    files: dict[str, str] = {}
    for key, path in local_paths(task).items():
        try:
            files[key] = store.pack(path)
        except ShipError as e:
            raise TaskError(f"{task.task_id}: {key} cannot be shipped to the nodes: {e}") from None
    return dataclasses.replace(task, files=files)


def localized(task: TaskRequest, where: Mapping[str, str]) -> TaskRequest:
    """The task with each path it names that `where` has (the path as the task names it ->
    a path on this node) replaced by that; the rest as it was."""
    def at(path: str | None) -> str | None:
        return where.get(path, path) if path is not None else None

    ws = dataclasses.replace(task.workspace, path=at(task.workspace.path), git=at(task.workspace.git))
    rt = task.runtime
    if rt is not None:
        transport, key, rest = image_file(rt.image)
        image = transport + where[key] + rest if key in where else rt.image

        def copies(actions: tuple[Action, ...]) -> tuple[Action, ...]:
            return tuple(dataclasses.replace(a, copy=at(a.copy)) for a in actions)

        rt = dataclasses.replace(rt, image=image, prepare=copies(rt.prepare), eval_prepare=copies(rt.eval_prepare))
    return dataclasses.replace(task, workspace=ws, runtime=rt)
