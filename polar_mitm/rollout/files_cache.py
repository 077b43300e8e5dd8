"""A gateway node's cache of the files shipped with tasks (shipped_files.py): each blob is
fetched from the rollout server (GET /files/{sha256}, with the node's server token) once per
node, verified, unpacked and kept; a task's paths are then rewritten to the cached copies
before anything on the node reads them (FilesCache.localize).

ROOT holds:
  <sha256>/content        the unpacked copy (renamed into place once complete)
  .locks/<sha256>.lock    held while one session fetches it; the others wait, then reuse it
  .tmp-*                  a download or unpack in progress

A blob is data from another machine: it is written under a temporary name, its sha256 must
be the one the task names, and before anything is unpacked every member is checked
(check_members): names under CONTENT only, no absolute name, no "..", no member twice, no
member inside a link, no hard link, device, fifo or other special file, no link that resolves
out of the tree. Files are made with their permission bits only (no setuid, setgid or
sticky bits), owned by the node's user."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tarfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable

import httpx

from ..models import cache_dir
from .shipped_files import CHUNK, CONTENT, SHA256, link_escapes, localized
from .spec import TaskRequest


class FilesError(RuntimeError):
    """A task's shipped files could not be fetched, or were refused: the infrastructure's
    failure, never the policy's."""


def default_root() -> Path:
    """Where a node caches shipped files unless told otherwise (NodeConfig.files_cache)."""
    return cache_dir() / "task-files"


# -- what a blob may hold --------------------------------------------------------------------------
def check_members(members: Iterable[tarfile.TarInfo]) -> None:
    """FilesError unless every member is safe to unpack (see the module's docstring)."""
    kinds: dict[str, str] = {}
    links: dict[str, str] = {}
    for m in members:
        name = m.name
        parts = name.split("/")
        if name.startswith("/"):
            raise FilesError(f"the blob holds an absolute path: {name[:200]!r}")
        if any(p in ("", ".", "..") for p in parts):
            raise FilesError(f"the blob holds a path with '..', '.' or an empty part: {name[:200]!r}")
        if parts[0] != CONTENT:
            raise FilesError(f"the blob holds a path outside {CONTENT}/: {name[:200]!r}")
        if name in kinds:
            raise FilesError(f"the blob holds {name[:200]!r} twice")
        parent = "/".join(parts[:-1])
        if parent and kinds.get(parent) != "dir":
            raise FilesError(f"the blob holds {name[:200]!r} inside something that is not one of its directories "
                             f"({'a link' if kinds.get(parent) == 'link' else 'missing or a file'})")
        if m.type == tarfile.DIRTYPE:
            kinds[name] = "dir"
        elif m.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
            kinds[name] = "file"
        elif m.type == tarfile.SYMTYPE:
            kinds[name] = "link"
            links[name] = m.linkname
        else:
            what = {tarfile.LNKTYPE: "a hard link", tarfile.CHRTYPE: "a character device",
                    tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a fifo"}.get(m.type, f"type {m.type!r}")
            raise FilesError(f"the blob holds {what} ({name[:200]!r}): only files, directories and links are unpacked")
    if kinds.get(CONTENT) not in ("dir", "file"):
        raise FilesError(f"the blob has no {CONTENT} (a directory or a file) at its top")
    for name, target in links.items():
        if link_escapes(links, name):
            raise FilesError(f"the blob's link {name[:200]!r} -> {target[:200]!r} points out of it")


def unpack(blob: Path, dest: Path) -> None:
    """The blob's members, checked first (check_members), into dest (a new directory): each
    made by this process, nothing followed, parents always directories made here."""
    try:
        with tarfile.open(blob, "r:") as tar:
            members = tar.getmembers()
            check_members(members)
            dest.mkdir(mode=0o700)
            dirs = []
            for m in members:
                path = os.path.join(dest, m.name)
                if m.type == tarfile.DIRTYPE:
                    os.mkdir(path, 0o700)
                    dirs.append((path, m.mode & 0o777))
                elif m.type == tarfile.SYMTYPE:
                    os.symlink(m.linkname, path)
                else:
                    src = tar.extractfile(m)
                    assert src is not None
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                    with os.fdopen(fd, "wb") as out:
                        shutil.copyfileobj(src, out, CHUNK)
                        os.fchmod(out.fileno(), m.mode & 0o777)
            for path, mode in reversed(dirs):     # children first: a read-only one is filled already
                os.chmod(path, mode)
    except (tarfile.TarError, EOFError) as e:
        raise FilesError(f"the blob is not a readable tar: {e}") from None


# -- the cache -------------------------------------------------------------------------------------
class _Retry(FilesError):
    """A failure another try may not have (the network, the server's 5xx, a torn download)."""


class FilesCache:
    """Shipped files on this node. client: the node's (its server token; no proxy from the
    environment); tries: downloads of one blob before giving up (backoff doubling from
    backoff seconds)."""

    def __init__(self, root: str | Path, client: httpx.Client, server_url: str, tries: int = 3,
                 backoff: float = 0.5):
        self.root, self.client, self.server_url = Path(root), client, server_url.rstrip("/")
        self.tries, self.backoff = tries, backoff
        self.fetches = 0            # blobs downloaded (not found in the cache)
        self._count = threading.Lock()

    def localize(self, task: TaskRequest) -> TaskRequest:
        """The task with every shipped path (task.files) rewritten to this node's copy,
        fetched first where the cache lacks it. FilesError where one cannot be had."""
        if not task.files:
            return task
        return localized(task, {path: str(self.get(sha)) for path, sha in task.files.items()})

    def get(self, sha256: str) -> Path:
        """The unpacked copy of the blob (ROOT/<sha256>/content), fetched once: concurrent
        callers (threads or processes) wait for the first."""
        if not SHA256.fullmatch(sha256):
            raise FilesError(f"{sha256[:80]!r} is not a sha256")
        entry = self.root / sha256
        if (entry / CONTENT).exists() or (entry / CONTENT).is_symlink():
            return entry / CONTENT
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.root / ".locks").mkdir(exist_ok=True, mode=0o700)
        with open(self.root / ".locks" / f"{sha256}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)      # released when the file closes
            if not entry.is_dir():
                self._fetch(sha256, entry)
        return entry / CONTENT

    def _fetch(self, sha256: str, entry: Path) -> None:
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        blob = tmp.with_suffix(".tar")
        try:
            for attempt in range(self.tries):
                try:
                    self._download(sha256, blob)
                    break
                except _Retry as e:
                    blob.unlink(missing_ok=True)
                    if attempt + 1 == self.tries:
                        raise FilesError(f"fetching {sha256[:12]} failed {self.tries} times: {e}") from None
                    time.sleep(self.backoff * 2 ** attempt)
            unpack(blob, tmp)
            os.rename(tmp, entry)
        except OSError as e:
            raise FilesError(f"caching {sha256[:12]} on this node failed: {e}") from None
        finally:
            blob.unlink(missing_ok=True)
            if tmp.exists():
                _remove(tmp)

    def _download(self, sha256: str, to: Path) -> None:
        with self._count:
            self.fetches += 1
        digest = hashlib.sha256()
        url = f"{self.server_url}/files/{sha256}"
        try:
            with self.client.stream("GET", url) as r:
                if r.status_code != 200:
                    why = f"{url} answered {r.status_code}: {r.read()[:200].decode('utf-8', 'replace')}"
                    if r.status_code >= 500:
                        raise _Retry(why)
                    raise FilesError(why)
                with open(to, "xb") as f:
                    for chunk in r.iter_bytes(CHUNK):
                        digest.update(chunk)
                        f.write(chunk)
        except httpx.HTTPError as e:
            raise _Retry(f"{url}: {str(e) or type(e).__name__}") from None
        if digest.hexdigest() != sha256:
            raise _Retry(f"the blob from {url} has sha256 {digest.hexdigest()}, not the one the task names")


def _remove(path: Path) -> None:
    """A directory unpacked here, read-only ones in it included."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    os.chmod(path, 0o700)
    shutil.rmtree(path, ignore_errors=True)
