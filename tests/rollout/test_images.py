"""Environment images (polar_mitm/rollout/images.py): references, the per-digest cache of
unpacked root filesystems, its locking and eviction, and a rootfs that bubblewrap runs.

The Debian test image is built once (scripts/build_test_image.sh, ~70 s) into the user cache
dir and reused by later runs; the eviction tests use tiny images made here with umoci."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from polar_mitm.rollout import images
from polar_mitm.rollout.images import Image, ImageCache, ImageError, transport


def _tool(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.fail(f"{argv[0]} is not installed (scripts/install.sh installs it as root: apt-get install {argv[0]})")
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def tiny_image(where: Path, name: str) -> Path:
    """An OCI layout (tag `t`) with one small file, /hello; each call gives another digest."""
    layer = _tar(where / f"{name}-layer.tar", {"hello": f"image {name}\n".encode()})
    layout = where / name
    _tool("umoci", "init", "--layout", str(layout))
    _tool("umoci", "new", "--image", f"{layout}:t")
    _tool("umoci", "raw", "add-layer", "--image", f"{layout}:t", str(layer))
    return layout


@pytest.fixture(scope="session")
def built() -> Path:
    """The Debian test image's OCI layout (its docker archive beside it, polar-test.tar)."""
    try:
        return images.test_image()
    except ImageError as e:
        pytest.fail(f"could not build the test image: {e}")


@pytest.fixture(scope="session")
def debian(built: Path, tmp_path_factory) -> tuple[ImageCache, Image]:
    """A cache shared by the tests below, and the image got cold into it from the layout."""
    cache = ImageCache(tmp_path_factory.mktemp("images"))
    return cache, cache.get(str(built))


# ---- references


def test_transport_forms(tmp_path: Path, monkeypatch) -> None:
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    docker_tar = _tar(tmp_path / "saved.tar", {"manifest.json": b"[]", "abc.json": b"{}"})
    oci_tar = _tar(tmp_path / "oci.tar", {"oci-layout": b"{}", "index.json": b"{}"})
    both_tar = _tar(tmp_path / "both.tar", {"oci-layout": b"{}", "index.json": b"{}", "manifest.json": b"[]"})
    # skopeo's own forms pass through
    for ref in (f"oci:{layout}", f"oci:{layout}:bookworm", f"oci-archive:{oci_tar}", f"oci-archive:{oci_tar}:v1",
                f"docker-archive:{docker_tar}", f"docker-archive:{docker_tar}:polar-test:bookworm",
                "docker://debian:bookworm", "docker://ghcr.io/x/y:1"):
        assert transport(ref) == ref
    # bare paths, by what they hold
    assert transport(str(layout)) == f"oci:{layout}"
    assert transport(str(docker_tar)) == f"docker-archive:{docker_tar}"
    assert transport(str(oci_tar)) == f"oci-archive:{oci_tar}"
    assert transport(str(both_tar)) == f"docker-archive:{both_tar}"      # a newer docker save
    monkeypatch.chdir(tmp_path)
    assert transport("layout") == f"oci:{layout}"
    assert transport("./saved.tar") == f"docker-archive:{docker_tar}"
    # names
    assert transport("debian:bookworm") == "docker://debian:bookworm"
    assert transport("ghcr.io/x/y:1") == "docker://ghcr.io/x/y:1"
    assert transport("python") == "docker://python"
    # what is not there, or not an image
    for ref in (str(tmp_path / "missing"), "./missing", "missing.tar", f"oci:{tmp_path}/missing:tag",
                f"docker-archive:{tmp_path}/missing.tar"):
        with pytest.raises(ImageError, match="no such file"):
            transport(ref)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ImageError, match="not an OCI image layout"):
        transport(str(tmp_path / "plain"))
    with pytest.raises(ImageError, match="not of an image"):
        transport(str(_tar(tmp_path / "other.tar", {"hello": b"hi"})))
    (tmp_path / "junk.tar").write_text("not a tar")
    with pytest.raises(ImageError, match="not a tar archive"):
        transport(str(tmp_path / "junk.tar"))
    with pytest.raises(ImageError, match="empty"):
        transport(" ")


def test_missing_tools_and_bad_refs_say_so(tmp_path: Path, monkeypatch) -> None:
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(ImageError, match="no such file"):
        cache.get(str(tmp_path / "nothing.tar"))
    with pytest.raises(ImageError, match="skopeo inspect.*failed"):
        cache.get("docker://localhost:1/nothing:1")        # no registry there
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setitem(images.TOOL_ENV, "PATH", str(tmp_path / "empty"))   # nor in the system's directories
    with pytest.raises(ImageError, match=r"skopeo is not installed \(apt-get install skopeo"):
        cache.get("debian:bookworm")


# ---- the Debian image


def test_get_unpacks_once_per_digest(built: Path, debian: tuple[ImageCache, Image]) -> None:
    cache, cold = debian
    assert cold.digest.startswith("sha256:") and len(cold.digest) == 71
    assert cold.rootfs == cache.root / cold.digest[7:] / "rootfs"
    assert cold.unpack_s > 0 and cold.size > 50 << 20
    for exe in ("usr/bin/python3", "usr/bin/git", "bin/sh"):
        assert os.path.exists(cold.rootfs / exe), exe
    assert cold.config["WorkingDir"] == "/workspace"
    assert any(e.startswith("PATH=") for e in cold.config["Env"])
    # the same image again, by the same ref, its tagged form and its docker archive: cached
    docker_tar = built.parent / "polar-test.tar"
    for ref in (str(built), f"oci:{built}:bookworm", str(docker_tar), f"docker-archive:{docker_tar}"):
        again = cache.get(ref)
        assert (again.digest, again.rootfs, again.size, again.unpack_s) == (cold.digest, cold.rootfs, cold.size, 0.0)
    assert cache.unpacks == 1
    [entry] = cache.entries()
    assert (entry.digest, entry.size, entry.ref) == (cold.digest, cold.size, str(built))
    assert not list(cache.root.glob(".tmp-*"))        # the layout copy is gone: only the rootfs stays


def test_rootfs_runs_in_bwrap_read_only(debian: tuple[ImageCache, Image]) -> None:
    _, image = debian
    check = ("import pytest, subprocess, sys\n"
             "git = subprocess.run(['git', '--version'], capture_output=True, text=True).stdout.strip()\n"
             "try:\n"
             "    open('/usr/bin/polar-was-here', 'w')\n"
             "    sys.exit('the rootfs is writable')\n"
             "except OSError:\n"
             "    pass\n"
             "open('/tmp/scratch', 'w').write('ok')\n"
             "print(pytest.__version__, git, sys.version.split()[0])\n")
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", str(image.rootfs), "/",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "/usr/bin/python3", "-c", check]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.fail("bwrap is not installed (apt-get install bubblewrap)")
    assert done.returncode == 0, done.stderr
    pytest_version, git, version, _, python = done.stdout.split()
    assert pytest_version[0].isdigit() and (git, version) == ("git", "version") and python.startswith("3."), done.stdout
    assert not (image.rootfs / "usr/bin/polar-was-here").exists()


def test_concurrent_gets_unpack_once(built: Path, tmp_path: Path) -> None:
    """Four threads, each with a cache object of its own (as processes would be) on one root,
    ask for the image at once, from its docker archive: one pulls and unpacks, the others
    wait for it and reuse its result."""
    ref = str(built.parent / "polar-test.tar")
    caches = [ImageCache(tmp_path / "cache") for _ in range(4)]
    start = threading.Barrier(4)
    got: list[Image] = []
    errors: list[BaseException] = []

    def worker(cache: ImageCache) -> None:
        start.wait()
        try:
            got.append(cache.get(ref))
        except BaseException as e:      # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(got) == 4
    assert sum(c.unpacks for c in caches) == 1
    assert sorted(i.unpack_s > 0 for i in got) == [False, False, False, True]
    assert len({(i.digest, i.rootfs) for i in got}) == 1
    assert (got[0].rootfs / "usr/bin/python3").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [got[0].digest[7:]]


# ---- eviction, with tiny images


def test_evicts_least_recently_used_unleased(tmp_path: Path) -> None:
    a, b, c = (str(tiny_image(tmp_path, n)) for n in "abc")
    cache = ImageCache(tmp_path / "cache")
    ia, ib = cache.get(a), cache.get(b)
    assert ia.digest != ib.digest and ia.size == ib.size > 0
    assert (ia.rootfs / "hello").read_text() == "image a\n"
    cache.max_bytes = 2 * ia.size + ia.size // 2          # room for two
    assert cache.get(a).unpack_s == 0                      # a used last: b is the least recently used
    ic = cache.get(c)
    assert ic.unpack_s > 0
    assert not ib.rootfs.exists() and ia.rootfs.exists() and ic.rootfs.exists()
    assert [e.digest for e in cache.entries()] == [ia.digest, ic.digest]
    assert cache.total_bytes() <= cache.max_bytes
    # a leased (by another cache object on the root, as another process would) is not evicted,
    # though least recently used: the next one is
    other = ImageCache(tmp_path / "cache")
    with other.lease(a) as leased:
        assert leased.digest == ia.digest and leased.unpack_s == 0
        cache.get(c)
        assert cache.get(b).unpack_s > 0
        assert ia.rootfs.exists() and not ic.rootfs.exists() and ib.rootfs.exists()
        assert cache.evict() == [] and cache.total_bytes() <= cache.max_bytes
    # released: a was used last (a release counts as a use), so the next unpack evicts b
    lease = cache.lease(c)                                  # acquire/release, without a with block
    assert lease.image.unpack_s > 0 and lease.image.rootfs.exists()
    assert not ib.rootfs.exists() and ia.rootfs.exists()    # b: got before a's release
    lease.release()
    lease.release()                                         # once is enough; twice is harmless
    assert not list(cache.root.glob(".trash-*")) and not list(cache.root.glob(".tmp-*"))


def test_image_bigger_than_the_bound_works_then_goes_first(tmp_path: Path) -> None:
    a, b = (str(tiny_image(tmp_path, n)) for n in "ab")
    cache = ImageCache(tmp_path / "cache", max_bytes=1)
    ia = cache.get(a)
    assert ia.size > cache.max_bytes and (ia.rootfs / "hello").read_text() == "image a\n"
    ib = cache.get(b)
    assert not ia.rootfs.exists() and (ib.rootfs / "hello").read_text() == "image b\n"
    assert cache.get(a).unpack_s > 0 and not ib.rootfs.exists()


def test_leftovers_of_a_crash_are_swept(tmp_path: Path) -> None:
    cache = ImageCache(tmp_path / "cache")
    image = cache.get(str(tiny_image(tmp_path, "a")))
    hexd = image.digest[7:]
    stale = cache.root / f".tmp-{hexd}"
    trash = cache.root / f".trash-{hexd}-0000"
    for d in (stale, trash):
        (d / "rootfs/etc").mkdir(parents=True)
        (d / "rootfs/etc").chmod(0o555)                     # as an image's modes may be
    (cache.root / "not-an-image").mkdir()
    ImageCache(cache.root)
    assert not stale.exists() and not trash.exists()
    assert json.loads((cache.root / hexd / "image.json").read_text())["digest"] == image.digest
