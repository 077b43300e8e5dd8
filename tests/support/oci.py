"""Tiny OCI images built here, in Python, with no network and no tools: an image layout
directory (oci-layout, index.json, a manifest, a config with Env and WorkingDir, one
uncompressed tar layer) that skopeo and umoci read like any other.

    layout(out, {"bin/busybox": File(data, 0o755), "bin/sh": Link("busybox"), "tmp": Dir(0o1777)},
           env={"PATH": "/bin"}, workdir="/workspace")

and the images the image tests use: `busybox_image` (Debian's busybox-static: one static
binary, no libc at all) and `musl_image` (a program built with musl-gcc, linked against
musl's loader, beside busybox's shell)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from polar_mitm.rollout.image_fit import elf_needs

TAG = "t"
BUSYBOX = Path("/bin/busybox")
MUSL_LOADER = Path("/lib/ld-musl-x86_64.so.1")
APPLETS = ("sh", "wget", "nc", "cat", "echo", "ls", "env", "sleep", "id", "true", "false", "test", "grep", "touch")


@dataclass(frozen=True)
class File:
    data: bytes
    mode: int = 0o644
    xattrs: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Link:
    target: str


@dataclass(frozen=True)
class Dir:
    mode: int = 0o755


Entry = File | Link | Dir


def _blob(out: Path, data: bytes, media_type: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (out / "blobs" / "sha256" / digest).write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _layer(files: dict[str, Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):       # parents first
            e = files[name]
            info = tarfile.TarInfo(name.strip("/"))
            info.mtime = 1_700_000_000
            if isinstance(e, Dir):
                info.type, info.mode = tarfile.DIRTYPE, e.mode
                tar.addfile(info)
            elif isinstance(e, Link):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, e.target, 0o777
                tar.addfile(info)
            else:
                info.size, info.mode = len(e.data), e.mode
                # PAX's extended attributes, as docker and buildah write them (binary values
                # go as surrogate escapes: tarfile marks the header BINARY)
                info.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                                    for k, v in e.xattrs.items()}
                tar.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def layout(out: Path, files: dict[str, Entry], *, env: dict[str, str] | None = None,
           workdir: str = "/workspace", tag: str = TAG) -> Path:
    """An OCI image layout at out (tag `tag`) with files as its one layer."""
    (out / "blobs" / "sha256").mkdir(parents=True)
    (out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    layer = _layer(files)
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": [f"{k}={v}" for k, v in (env or {}).items()], "WorkingDir": workdir},
              "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": _blob(out, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
                "layers": [_blob(out, layer, "application/vnd.oci.image.layer.v1.tar")]}
    m = _blob(out, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    m["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [m]}))
    return out


def busybox_files() -> dict[str, Entry]:
    """A root of Debian's busybox-static alone: /bin/busybox and its applets' links."""
    needs = elf_needs(str(BUSYBOX)) if BUSYBOX.is_file() else None
    if needs is None or needs.interp is not None:
        raise FileNotFoundError(f"{BUSYBOX} is missing or not static: apt-get install busybox-static "
                                "(scripts/install.sh does)")
    files: dict[str, Entry] = {d: Dir() for d in ("bin", "workspace", "etc")}
    files["tmp"] = Dir(0o1777)
    files["bin/busybox"] = File(BUSYBOX.read_bytes(), 0o755)
    files.update({f"bin/{a}": Link("busybox") for a in APPLETS})
    return files


def busybox_image(out: Path, extra: dict[str, Entry] | None = None, env: dict[str, str] | None = None) -> Path:
    return layout(out, {**busybox_files(), **(extra or {})}, env={"PATH": "/bin", **(env or {})})


MUSL_PROBE = r"""
/* GET the proxy's port on loopback and print its status line: a program linked against musl */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
int main(int argc, char **argv) {
    struct sockaddr_in a = {0};
    char buf[512];
    int s = socket(AF_INET, SOCK_STREAM, 0), n;
    a.sin_family = AF_INET;
    a.sin_port = htons(atoi(argv[1]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) { perror("connect"); return 2; }
    const char *req = "GET http://polar.invalid/ HTTP/1.0\r\n\r\n";
    write(s, req, strlen(req));
    n = read(s, buf, sizeof buf - 1);
    if (n <= 0) { perror("read"); return 3; }
    buf[n] = 0;
    buf[strcspn(buf, "\r\n")] = 0;
    printf("musl probe: %s\n", buf);
    return 0;
}
"""


def musl_probe(work: Path) -> Path:
    """musl_probe PORT, built with musl-gcc (dynamically linked: its interpreter is musl's
    loader)."""
    cc = shutil.which("musl-gcc")
    if cc is None:
        raise FileNotFoundError("musl-gcc is missing: apt-get install musl-tools (scripts/install.sh does)")
    src = work / "musl_probe.c"
    src.write_text(MUSL_PROBE)
    exe = work / "musl_probe"
    subprocess.run([cc, "-O1", "-o", str(exe), str(src)], check=True, capture_output=True, timeout=120)
    return exe


def musl_image(out: Path, work: Path) -> Path:
    """musl's loader (which is its libc) and a program linked against it, with busybox's
    shell for the command harness: no glibc anywhere."""
    files = busybox_files()
    files.update({"lib": Dir(), "lib/ld-musl-x86_64.so.1": File(MUSL_LOADER.read_bytes(), 0o755),
                  "bin/musl_probe": File(musl_probe(work).read_bytes(), 0o755)})
    return layout(out, files, env={"PATH": "/bin"})
