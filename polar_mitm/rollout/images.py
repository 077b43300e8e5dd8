"""Environment images: a task's `runtime.image`, pulled and unpacked once per gateway node.

A reference is anything skopeo reads (`transport`): an OCI layout, an OCI or docker archive,
or a registry name. `ImageCache` keys an image by its digest, the sha256 of its config as
the source holds it (docker's image ID): the config names the layers by the digests of their
uncompressed contents, so one image is one entry whether it comes as an OCI layout, a docker
archive or from a registry, as long as its copies keep the config's bytes (skopeo's copy to
a docker archive does; a conversion that re-encodes the config gives another digest: the same
files unpacked twice, never the wrong ones).
It is unpacked once (`umoci raw unpack --rootless`: files owned by the node's user, no
device nodes) into ROOT/<hex>/rootfs, which sessions share read-only. An image is data, never
a program the node trusts: at unpack its setuid/setgid bits and file capabilities
(security.capability) are stripped (`sanitize`), the cache root and every entry in it are 0700
(the node's user alone goes in), and skopeo and umoci run by their absolute paths with a clean
environment.

ROOT holds:
  <hex>/rootfs          the unpacked root filesystem
  <hex>/image.json      ref, digest, config, unpacked bytes, unpack seconds
  <hex>/used            its mtime: when the image was last got, leased or released
  .locks/<hex>.unpack   exclusive while one pulls and unpacks it; the others wait, then reuse it
  .locks/<hex>.lease    shared while sessions use it; eviction takes it exclusively, never waiting
  .tmp-<hex>/           an unpack in progress, renamed to <hex> when done
  .trash-*/             an evicted image on its way out

The lock files outlive the images (a few bytes each): a lock held on a file that was since
removed would guard nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Iterator

from ..models import cache_dir

log = logging.getLogger("polar.images")

# skopeo's transports; those that name a local file or directory are checked here first.
TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:", "docker://", "dir:", "docker-daemon:",
              "containers-storage:")
FILE_TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:", "dir:")
TAG = "image"                   # the tag of the cache's own copy of an image
META, USED = "image.json", "used"
SANITIZED = 1                   # image.json's "sanitized": the version of `sanitize` its rootfs went through
TEST_IMAGE = "polar-test:bookworm"      # the image scripts/build_test_image.sh builds (tests, the bug-fix tasks)
CACHE_ENV = "POLAR_IMAGE_CACHE"         # where a node unpacks images (default: default_root())
TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}   # skopeo's, umoci's: nothing else
# but these of the node's own: where its registry credentials are, its proxies, the mirror
# the test image is built from
PASSED_ENV = ("HOME", "TMPDIR", "REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
              "http_proxy", "NO_PROXY", "no_proxy", "POLAR_DEBIAN_MIRROR")
INSPECT_TIMEOUT = 300
PULL_TIMEOUT = 3600             # a registry pull of a few GB
UNPACK_TIMEOUT = 3600
BUILD_TIMEOUT = 1800
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_test_image.sh"


class ImageError(RuntimeError):
    """An image that cannot be pulled or unpacked: the message says why and what to do."""


@dataclass(frozen=True)
class Image:
    ref: str                    # as the task named it
    digest: str                 # sha256:... of the image's config
    rootfs: Path                # the unpacked root filesystem: read-only, shared
    config: dict = field(compare=False)     # the OCI config's `config`: Env, WorkingDir, User, Entrypoint, Cmd
    size: int = 0               # unpacked bytes
    unpack_s: float = 0.0       # what this get spent pulling and unpacking; 0.0 when it was cached


@dataclass(frozen=True)
class Entry:
    """One unpacked image in the cache."""
    digest: str
    ref: str                    # the reference it was first unpacked for
    size: int
    last_used: float            # time.time() of its last get, lease or release
    rootfs: Path


# ---- running skopeo and umoci


def tool_path(name: str) -> str | None:
    """The absolute path of a program the node runs outside any sandbox (skopeo, umoci,
    unshare, nsenter, mount, git): found on the node's own PATH (its absolute directories
    only), then in the system's; never on a PATH that an image or a task set."""
    mine = [d for d in os.environ.get("PATH", "").split(os.pathsep) if os.path.isabs(d)]
    return shutil.which(name, path=os.pathsep.join([*mine, TOOL_ENV["PATH"]]))


def _run(argv: list[str], what: str, timeout: float) -> bytes:
    """argv's stdout; ImageError (with the tool's stderr) where it is missing or fails. The
    tool is found by its absolute path (tool_path), and runs with a clean environment but the
    node's own PASSED_ENV."""
    exe = tool_path(argv[0])
    if exe is None:
        raise ImageError(f"{argv[0]} is not installed (apt-get install {argv[0]}, or scripts/install.sh as root)")
    env = {**TOOL_ENV, **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}}
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env=env)
    except subprocess.TimeoutExpired:
        raise ImageError(f"{what}: `{' '.join(argv[:3])} ...` took over {timeout:.0f} s") from None
    except OSError as e:
        raise ImageError(f"{what}: could not run {argv[0]}: {e}") from None
    if done.returncode != 0:
        err = (done.stderr or done.stdout).decode(errors="replace").strip()
        hint = " (skopeo reads its trust policy there: install containers-common)" if "policy.json" in err else ""
        raise ImageError(f"{what}: `{' '.join(argv[:3])} ...` failed (exit {done.returncode}): "
                         f"{err[-800:]}{hint}")
    return done.stdout


def _inspect_config(src: str, what: str) -> tuple[str, dict]:
    """(digest, the OCI config) of the image src names, as skopeo reads it: the raw config
    bytes, whose sha256 is the digest."""
    raw = _run(["skopeo", "inspect", "--config", "--raw", src], what, INSPECT_TIMEOUT)
    try:
        config = json.loads(raw)
    except ValueError:
        raise ImageError(f"{what}: its config is not JSON") from None
    if not isinstance(config, dict):
        raise ImageError(f"{what}: its config is not a JSON object")
    return "sha256:" + hashlib.sha256(raw).hexdigest(), config


# ---- references


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..") or ref.endswith((".tar", ".tar.gz", ".tgz"))


def _archive_kind(path: Path, ref: str) -> str:
    """docker-archive or oci-archive, from what the tar holds at its top."""
    try:
        with tarfile.open(path, "r:*") as tar:
            names = set()
            for member in tar:
                name = member.name.removeprefix("./")
                if name == "manifest.json":     # docker save; newer ones hold an oci-layout too
                    return "docker-archive"
                names.add(name)
    except (tarfile.TarError, OSError) as e:
        raise ImageError(f"image {ref}: {path} is not a tar archive of an image ({e})") from None
    if "oci-layout" in names:
        return "oci-archive"
    raise ImageError(f"image {ref}: {path} is a tar archive but not of an image "
                     "(neither manifest.json, as docker save writes, nor oci-layout at its top)")


def transport(ref: str) -> str:
    """The skopeo source for a task's image reference: skopeo's own forms (oci:DIR[:TAG],
    oci-archive:FILE[:TAG], docker-archive:FILE[:REF], docker://NAME[:TAG], ...) as they are;
    a directory holding an OCI layout -> oci:DIR; a tar archive -> docker-archive: or
    oci-archive: by its contents; anything else is a registry name (debian:bookworm,
    ghcr.io/x/y:1) -> docker://NAME."""
    ref = ref.strip()
    if not ref:
        raise ImageError("the image reference is empty")
    for t in TRANSPORTS:
        if ref.startswith(t):
            if t in FILE_TRANSPORTS:
                path = ref[len(t):].split(":", 1)[0]
                if not os.path.exists(path):
                    raise ImageError(f"image {ref}: {path}: no such file or directory")
            return ref
    path = os.path.expanduser(ref)
    if not (_looks_like_path(ref) or os.path.exists(path)):
        return "docker://" + ref
    p = Path(os.path.abspath(path))
    if not p.exists():
        raise ImageError(f"image {ref}: no such file or directory")
    if ":" in str(p):
        raise ImageError(f"image {ref}: skopeo cannot read a path with ':' in it ({p}); rename or link it")
    if p.is_dir():
        if (p / "oci-layout").is_file():
            return f"oci:{p}"
        raise ImageError(f"image {ref}: {p} is a directory but not an OCI image layout (no oci-layout file)")
    return f"{_archive_kind(p, ref)}:{p}"


# ---- files and locks


def _open_lock(path: Path) -> int:
    # O_CLOEXEC: a lock must not live on in skopeo or umoci
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def _flock(path: Path, how: int) -> Iterator[bool]:
    """Holds an flock on path for the block; yields False where LOCK_NB found it taken.
    flock, not lockf: its locks belong to the open file, so threads exclude each other too."""
    fd = _open_lock(path)
    try:
        try:
            fcntl.flock(fd, how)
            got = True
        except BlockingIOError:
            got = False
        yield got
    finally:
        os.close(fd)


def _touch(path: Path) -> None:
    # time.time(), not the kernel's own clock for utime: that one is coarse (a few ms), and
    # the order of uses is what eviction goes by
    now = time.time()
    path.touch()
    os.utime(path, (now, now))


def _du(top: Path) -> int:
    """Bytes on disk under top, each hard-linked file once."""
    total, seen = 0, set()
    stack = [str(top)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return total


def _open_up(top: Path) -> None:
    """u+rwx on every directory under top: a rootless unpack keeps the image's modes (a 0555
    directory, a 0700 /root), and those stop its non-root owner from removing what is in them."""
    def rwx(p: str) -> None:
        with contextlib.suppress(OSError):
            os.chmod(p, stat.S_IMODE(os.lstat(p).st_mode) | 0o700)
    rwx(str(top))
    for dirpath, dirnames, _ in os.walk(top):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                rwx(p)


def sanitize(top: Path) -> int:
    """Strips what would make a file of the image a privilege on this machine: setuid and
    setgid bits, and file capabilities (the security.capability attribute). Links are never
    followed. Returns how many files it changed."""
    changed = 0
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            hit = False
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(p, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                hit = True
            if stat.S_ISREG(st.st_mode):
                try:
                    os.removexattr(p, "security.capability", follow_symlinks=False)
                    hit = True
                except OSError:
                    pass                # none (ENODATA), or a filesystem without xattrs
            changed += hit
    return changed


def _private(path: Path) -> None:
    """path made 0700 where this process owns it (the cache's directories)."""
    with contextlib.suppress(OSError):
        if path.stat().st_uid == os.geteuid():
            os.chmod(path, 0o700)


def _remove(path: Path) -> None:
    """Removes a tree, whatever its directories' modes; what is already gone is fine."""
    def gone_ok(func, p, exc_info) -> None:
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]
    if not os.path.lexists(path):
        return
    try:
        shutil.rmtree(path, onerror=gone_ok)
    except PermissionError:
        _open_up(path)
        shutil.rmtree(path, onerror=gone_ok)


# ---- the cache


class Lease:
    """An image held in use: while the lease is held, no ImageCache evicts the image. Hold it
    for the session's lifetime; `release` (or leaving its with block) ends it."""

    def __init__(self, image: Image, fd: int, used: Path):
        self.image = image
        self._fd: int | None = fd
        self._used = used

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            _touch(self._used)          # in use until now
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Image:
        return self.image

    def __del__(self) -> None:
        # a lease dropped unreleased would keep its image from eviction for the process's life
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __exit__(self, *exc: object) -> None:
        self.release()


class ImageCache:
    """Images unpacked under root, at most max_bytes of them (unpacked) beyond those in use.
    Safe to share between threads, and between processes on the same root."""

    def __init__(self, root: Path, max_bytes: int = 20 << 30):
        self.root = Path(root).absolute()
        if ":" in str(self.root):
            raise ImageError(f"image cache {self.root}: skopeo cannot use a path with ':' in it")
        self.max_bytes = max_bytes
        self.unpacks = 0                # unpacks this object did (tests, reports)
        self._count = threading.Lock()
        (self.root / ".locks").mkdir(parents=True, exist_ok=True, mode=0o700)
        # the node's user alone goes in: a rootfs holds the image's files as the image made them
        for d in (self.root, self.root / ".locks", *(e for e in self.root.iterdir() if e.is_dir())):
            _private(d)
        self._sweep()

    def _lock(self, hexd: str, kind: str) -> Path:
        return self.root / ".locks" / f"{hexd}.{kind}"

    def _sweep(self) -> None:
        """What a crashed process left: an unpack no one is doing, an eviction half done."""
        for p in self.root.glob(".tmp-*"):
            with _flock(self._lock(p.name.removeprefix(".tmp-"), "unpack"), fcntl.LOCK_EX | fcntl.LOCK_NB) as got:
                if got:
                    _remove(p)
        for p in self.root.glob(".trash-*"):
            with contextlib.suppress(OSError):
                _remove(p)

    def resolve(self, ref: str) -> tuple[str, str, dict]:
        """(the skopeo source, the digest, the OCI config) of ref, without pulling its layers."""
        src = transport(ref)
        digest, config = _inspect_config(src, f"image {ref}")
        return src, digest, config

    def get(self, ref: str) -> Image:
        """The image ref names, unpacked: pulled and unpacked the first time, else the cached
        one (unpack_s 0.0). Without a lease, a later eviction may remove it: a session that
        uses the rootfs holds `lease(ref)` instead."""
        image, _ = self._get(ref, hold=False)
        return image

    def lease(self, ref: str) -> Lease:
        """get(ref), held in use until the Lease is released: `with cache.lease(ref) as image:`."""
        image, fd = self._get(ref, hold=True)
        assert fd is not None
        return Lease(image, fd, self.root / image.digest.split(":", 1)[1] / USED)

    def _get(self, ref: str, hold: bool) -> tuple[Image, int | None]:
        src, digest, config = self.resolve(ref)
        hexd = digest.split(":", 1)[1]
        entry = self.root / hexd
        fd = None
        took = 0.0
        # Under the digest's unpack lock: one unpack, the others wait for it. The lease is
        # taken before the lock goes, so no eviction comes in between.
        with _flock(self._lock(hexd, "unpack"), fcntl.LOCK_EX):
            if not (entry / META).is_file():
                t0 = time.monotonic()
                self._unpack(ref, src, digest, config, entry)
                took = time.monotonic() - t0
                with self._count:
                    self.unpacks += 1
            else:
                self._resanitize(entry)
            try:
                if hold:
                    fd = _open_lock(self._lock(hexd, "lease"))
                    fcntl.flock(fd, fcntl.LOCK_SH)
                _touch(entry / USED)
                meta = json.loads((entry / META).read_text())
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
        image = Image(ref=ref, digest=digest, rootfs=entry / "rootfs", config=meta["config"],
                      size=meta["bytes"], unpack_s=took)
        if took:
            self.evict(keep={digest})
        return image, fd

    def _resanitize(self, entry: Path) -> None:
        """An entry unpacked before `sanitize` was (the caller holds its unpack lock)."""
        meta = json.loads((entry / META).read_text())
        if meta.get("sanitized") == SANITIZED:
            return
        _private(entry)
        n = sanitize(entry / "rootfs")
        fresh = entry / f".{META}.tmp"
        fresh.write_text(json.dumps({**meta, "sanitized": SANITIZED}))
        os.rename(fresh, entry / META)          # whole for every reader
        log.info("image cache: %s: stripped setuid/setgid bits and capabilities of %d files", entry.name, n)

    def _unpack(self, ref: str, src: str, digest: str, config: dict, entry: Path) -> None:
        """Pulls src into a layout of its own, unpacks it and moves the result to entry, all or
        nothing. The caller holds the digest's unpack lock: a .tmp- left by a crash is stale."""
        tmp = self.root / f".tmp-{entry.name}"
        _remove(tmp)
        tmp.mkdir(mode=0o700)
        try:
            layout = f"{tmp}/layout"
            what = f"image {ref}"
            # The copy lives for the unpack only: layers that skopeo has to compress (a docker
            # archive's), it compresses fast. (Leaving them uncompressed, skopeo 1.9 labels
            # them gzip all the same, which umoci cannot read.)
            _run(["skopeo", "copy", "--quiet", "--dest-compress-level", "1", src, f"oci:{layout}:{TAG}"],
                 what, PULL_TIMEOUT)
            # What is unpacked must be what was inspected: a registry tag may have moved since.
            # By content, not bytes: skopeo re-encodes a docker config that it makes an OCI one.
            pulled, pulled_config = _inspect_config(f"oci:{layout}:{TAG}", what)
            if pulled_config != config:
                raise ImageError(f"{what} changed while it was pulled (config {digest}, then {pulled}): try again")
            out = tmp / "entry"
            out.mkdir(mode=0o700)
            _run(["umoci", "raw", "unpack", "--rootless", "--image", f"{layout}:{TAG}", str(out / "rootfs")],
                 what, UNPACK_TIMEOUT)
            sanitize(out / "rootfs")
            size = _du(out / "rootfs")
            meta = {"ref": ref, "digest": digest, "config": config.get("config") or {}, "bytes": size,
                    "unpack_s": 0.0, "unpacked_at": time.time(), "sanitized": SANITIZED}
            (out / META).write_text(json.dumps(meta))
            _touch(out / USED)
            os.rename(out, entry)
        finally:
            _remove(tmp)            # the layout copy too: the rootfs is all the cache keeps

    def entries(self) -> list[Entry]:
        """The unpacked images, least recently used first."""
        found = []
        for d in self.root.iterdir():
            if len(d.name) != 64 or d.name.startswith("."):
                continue
            try:
                meta = json.loads((d / META).read_text())
                used = (d / USED).stat().st_mtime
            except (OSError, ValueError):
                continue            # being evicted
            found.append(Entry(digest=meta["digest"], ref=meta["ref"], size=meta["bytes"], last_used=used,
                               rootfs=d / "rootfs"))
        return sorted(found, key=lambda e: e.last_used)

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def evict(self, keep: Collection[str] = ()) -> list[str]:
        """Removes the least recently used images that no one leases or unpacks (and not in
        keep, digests) until the cache holds at most max_bytes; returns the digests removed.
        An image bigger than max_bytes stays while it is the one just unpacked."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed = []
        for e in entries:
            if total <= self.max_bytes:
                break
            if e.digest not in keep and self._evict_one(e.digest.split(":", 1)[1]):
                total -= e.size
                removed.append(e.digest)
        return removed

    def _evict_one(self, hexd: str) -> bool:
        nb = fcntl.LOCK_EX | fcntl.LOCK_NB
        with _flock(self._lock(hexd, "unpack"), nb) as free, _flock(self._lock(hexd, "lease"), nb) as unleased:
            if not (free and unleased and (self.root / hexd / META).is_file()):
                return False
            trash = self.root / f".trash-{hexd}-{uuid.uuid4().hex[:8]}"
            os.rename(self.root / hexd, trash)   # gone at once for every reader; removed below
        try:
            _remove(trash)
        except OSError as e:
            log.warning("image cache: could not remove %s: %s", trash, e)
        log.info("image cache: evicted sha256:%s", hexd)
        return True


def default_root() -> Path:
    """Where a node keeps its unpacked images unless told otherwise."""
    return cache_dir() / "images" / "unpacked"


def cache_root() -> Path:
    """Where this node keeps its unpacked images: $POLAR_IMAGE_CACHE, else default_root()."""
    return Path(os.environ.get(CACHE_ENV) or default_root())


def unpacked_here(ref: str) -> Path | None:
    """The rootfs of ref where this machine already holds it unpacked (in cache_root()), found
    without pulling anything: a local image only (a layout or an archive; the test image by
    its name once built), else None. Read only: nothing is locked, made or leased."""
    try:
        if ref == TEST_IMAGE:
            built = cache_dir() / "images" / "build" / "oci"
            if not (built / "index.json").is_file():
                return None
            ref = str(built)
        src = transport(ref)
        if not src.startswith(FILE_TRANSPORTS):
            return None
        path = src.split(":", 1)[1].split(":", 1)[0]
        digest = _local_digest(src, os.stat(path).st_mtime_ns)
    except (ImageError, OSError):
        return None
    entry = cache_root() / digest.split(":", 1)[1]
    return entry / "rootfs" if (entry / META).is_file() else None


@functools.lru_cache(maxsize=256)
def _local_digest(src: str, mtime_ns: int) -> str:
    """A local image's digest, asked of skopeo once per version of the file (its mtime)."""
    return _inspect_config(src, f"image {src}")[0]


def test_image(out: Path | None = None) -> Path:
    """Builds the test image once (scripts/build_test_image.sh into out, by default
    cache_dir()/images/build) and returns its OCI layout (tag `bookworm`); the docker archive
    lies beside it, as polar-test.tar. Tests and demos share the one build."""
    out = Path(out) if out is not None else cache_dir() / "images" / "build"
    if not BUILD_SCRIPT.is_file():
        raise ImageError(f"{BUILD_SCRIPT} is missing: the test image is built from a source checkout")
    out.mkdir(parents=True, exist_ok=True)
    # one build at a time (pytest workers, a demo beside them); the script skips a finished one
    with _flock(out.parent / f".{out.name}.lock", fcntl.LOCK_EX):
        _run(["bash", str(BUILD_SCRIPT), str(out)], "building the test image", BUILD_TIMEOUT)
    return out / "oci"


test_image.__test__ = False     # type: ignore[attr-defined]  # not a test, whatever pytest thinks of its name
