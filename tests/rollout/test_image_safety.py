"""Images are data, not code the node runs; any image runs, or says why it can't (issue 41).

Images built here in Python (support/oci.py), no network: busybox (Debian's busybox-static:
one static binary, no libc), musl (a program linked against musl's loader), and the Debian
test image (scripts/build_test_image.sh). One rollout through a real gateway, real sandboxes:

- each image's `command` session reaches the proxy through the bridge (the node's namespace,
  nothing of the node inside the image): a model call recorded in the database (busybox's
  wget, Debian's Python), the proxy's answer to a musl-linked program;
- the busybox image's Env holds LD_PRELOAD of a host library that marks a file when loaded,
  and a relative PATH that finds fake `mount`, `bwrap`, `nsenter`, `unshare`, `setpriv` in
  the session's directory: no helper of the node loads or runs them, and the command inside
  sees the image's Env as it is;
- `runtime.network: "none"`: loopback alone, the proxy's port unreachable;
- a Pi task on the busybox image: refused with what the image lacks (at the node's INIT,
  unscored, then at submission once the image is unpacked here).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from polar_mitm.rollout import bwrap as bw
from polar_mitm.rollout import images
from polar_mitm.rollout import runtime as rt
from polar_mitm.rollout.images import ImageCache
from polar_mitm.rollout.rewards import reward_record
from polar_mitm.rollout.runtime import TEST_IMAGE, LocalRuntime
from polar_mitm.rollout.spec import RuntimeSpec, TaskError, Workspace, parse_task
from polar_mitm.store import query
from support import oci
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts, session_logs

needs_bwrap = pytest.mark.skipif(bw.probe()[0] is None, reason=f"no bwrap sandbox here: {bw.probe()[1]}")

FAKE_TOOLS = ("mount", "bwrap", "nsenter", "unshare", "setpriv", "git", "skopeo", "umoci")
CHAT = '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
PY_CALL = ("import json, os, urllib.request as u; "
           "r = u.urlopen(u.Request('https://api.openai.com/v1/chat/completions', data=json.dumps("
           "{'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 8}).encode(), "
           "headers={'content-type': 'application/json', 'authorization': 'Bearer x'}), timeout=60); "
           "print('debian call', r.status)")
# a capability that would let any user of the node open raw sockets (cap_net_raw+ep)
CAP_NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


def _preload_library(where: Path, marker: Path) -> Path:
    """A shared library that appends to marker when a program loads it."""
    src = where / "preload.c"
    src.write_text('#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void mark(void) '
                   f'{{ int fd = open("{marker}", O_WRONLY | O_CREAT | O_APPEND, 0644); '
                   'if (fd >= 0) { write(fd, "loaded\\n", 7); close(fd); } }\n')
    out = where / "preload.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True, timeout=120)
    return out


@needs_bwrap
def test_unpacking_strips_setuid_setgid_and_capabilities_and_keeps_the_cache_private(tmp_path):
    layout = oci.busybox_image(tmp_path / "suid", extra={
        "bin/suid": oci.File(b"#!/bin/sh\n", 0o4755), "bin/sgid": oci.File(b"#!/bin/sh\n", 0o2755),
        "bin/capped": oci.File(b"#!/bin/sh\n", 0o755, {"security.capability": CAP_NET_RAW})})
    # the control: unpacked as umoci does it, the image keeps them
    raw = tmp_path / "raw"
    subprocess.run(["umoci", "raw", "unpack", "--rootless", "--image", f"{layout}:{oci.TAG}", str(raw)],
                   check=True, capture_output=True, timeout=120)
    assert os.stat(raw / "bin/suid").st_mode & stat.S_ISUID and os.stat(raw / "bin/sgid").st_mode & stat.S_ISGID
    assert os.getxattr(raw / "bin/capped", "security.capability") == CAP_NET_RAW
    cache = ImageCache(tmp_path / "cache")
    image = cache.get(str(layout))
    for name in ("suid", "sgid", "capped"):
        st = os.stat(image.rootfs / "bin" / name)
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID) and st.st_mode & 0o777 == 0o755, (name, oct(st.st_mode))
        with pytest.raises(OSError):
            os.getxattr(image.rootfs / "bin" / name, "security.capability")
    for d in (cache.root, image.rootfs.parent, cache.root / ".locks"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (cache.root / ".locks").iterdir())


def test_network_none_with_a_harness_that_calls_the_model_is_refused():
    image = {"image": "polar-test:bookworm", "network": "none"}
    with pytest.raises(TaskError, match="network \"none\" leaves a session no route.*harness \"command\""):
        parse_task({"task_id": "t", "instruction": "x", "harness": "pi", "runtime": image})
    assert parse_task({"task_id": "t", "instruction": "x", "harness": "command", "command": "true",
                       "runtime": image}).runtime.network == "none"


@needs_bwrap
def test_any_image_runs_or_says_why_it_cannot(start_proxy, tmp_path):
    images.test_image()      # built once per machine (about 80 s), then cached
    marker = tmp_path / "marker"
    preload = _preload_library(tmp_path, marker)
    subprocess.run(["/bin/true"], env={"LD_PRELOAD": str(preload)}, check=True)
    assert marker.read_text() == "loaded\n"    # armed: a program that loads it marks the file
    marker.unlink()
    ws = tmp_path / "ws"        # the session's workdir, where the relative PATH leads
    ws.mkdir()
    for tool in FAKE_TOOLS:
        (ws / tool).write_text(f"#!/bin/sh\necho {tool} >> {marker}\n")
        (ws / tool).chmod(0o755)
    # a digest of its own (a nonce in its Env), not unpacked yet by this or an earlier run
    busybox = oci.busybox_image(tmp_path / "busybox", env={"PATH": "work:.:/bin", "LD_PRELOAD": str(preload),
                                                           "POLAR_TEST_NONCE": uuid.uuid4().hex})
    musl = oci.musl_image(tmp_path / "musl", tmp_path)
    port = "${http_proxy##*:}"
    # a model call by hand (busybox's wget sends no POST through a proxy): plain HTTP to the
    # proxy, the session named by the proxy URL's user, as every client sends it. busybox's nc
    # ends at its input's end: the input stays open until the answer is in (30 s at most)
    call = ("up=${http_proxy#http://}; up=${up%@*}; "
            f"body='{CHAT}'; (printf 'POST http://api.openai.com/v1/chat/completions HTTP/1.0\\r\\n"
            "Host: api.openai.com\\r\\nProxy-Authorization: Basic %s\\r\\nAuthorization: Bearer x\\r\\n"
            "Content-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n%s' "
            '"$(printf %s "$up" | base64)" ${#body} "$body"; i=0; '
            "while ! grep -q chat.completion /tmp/answer && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done) "
            f"| nc 127.0.0.1 {port} > /tmp/answer; cat /tmp/answer")
    tasks = [
        {"task_id": "busybox", "command": f'echo "preload=$LD_PRELOAD path=$PATH"; {call}',
         "runtime": {"image": str(busybox)}, "workspace": {"path": str(ws)}},
        {"task_id": "musl", "command": f"musl_probe {port}", "runtime": {"image": str(musl)}},
        {"task_id": "debian", "command": f"python3 -c \"{PY_CALL}\"", "runtime": {"image": TEST_IMAGE}},
        {"task_id": "no-route", "runtime": {"image": str(busybox), "network": "none"},
         "command": f"if echo | nc 127.0.0.1 {port}; then echo REACHED; exit 1; fi; echo no route"},
    ]
    tasks = [{"instruction": "x", "harness": "command", **t} for t in tasks]
    pi = {"task_id": "pi-busybox", "instruction": "x", "harness": "pi", "runtime": {"image": str(busybox)}}
    runtime = LocalRuntime(tmp_path / "sessions", sandbox="bwrap", keep=True)
    with FakeVLLM() as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, runtime, backend_url=backend.url) as rollouts:
            # Pi first: submitted before any session unpacks the image, it is refused at set-up
            groups = rollouts.run([pi, *tasks], timeout=300)
            # the busybox image is unpacked here now: a Pi task on it is refused as it comes in
            with pytest.raises(TaskError, match="cannot run the pi harness.*ld-linux-x86-64.so.2.*libstdc"):
                rollouts.server.submit({**pi, "task_id": "pi-again"})
    s = {tid: g["sessions"][0] for tid, g in groups.items()}
    logs = session_logs(runtime)
    for tid in ("busybox", "musl", "debian", "no-route"):
        assert s[tid]["state"] == "done" and s[tid]["stats"]["exit_code"] == 0, (tid, s[tid], logs)
    _, rows = query(proxy.db, "SELECT session_id, count(*) FROM call_records WHERE error IS NULL GROUP BY 1")
    assert dict(rows) == {"busybox~0": 1, "debian~0": 1}, (rows, logs)
    out = {tid: next(runtime.base.glob(f"{tid}-0-*/logs/harness.log")).read_text() for tid in s
           if tid != "pi-busybox"}
    assert f"preload={preload} path=/run/polar/bin:work:.:/bin" in out["busybox"], out["busybox"]
    assert "chat.completion" in out["busybox"] and "debian call 200" in out["debian"], out
    assert "musl probe: HTTP/1.1 " in out["musl"], out["musl"]
    assert "no route" in out["no-route"] and "REACHED" not in out["no-route"], out["no-route"]
    assert not marker.exists(), marker.read_text()    # no helper of the node loaded or ran the image's
    refused = s["pi-busybox"]
    assert refused["state"] == "failed" and "cannot run the pi harness" in refused["reason"], refused
    for lacks in ("/lib64/ld-linux-x86-64.so.2", "libstdc++.so.6", "libc.so.6"):
        assert lacks in refused["reason"], refused["reason"]
    assert reward_record(refused, "zero") is None       # the image's failing, not the policy's
    assert not list(runtime.base.glob("pi-busybox-0-*/logs/harness.log"))     # it never started


@needs_bwrap
def test_where_the_node_cannot_make_the_namespace_the_bridge_runs_inside_or_the_image_says_why(tmp_path,
                                                                                               monkeypatch):
    """A node that is not root cannot make a session's network namespace itself: the bridge
    then runs inside, on the node's Python, which an image with glibc runs (the Debian test
    image: its session still reaches the proxy's port), and an image without is refused at
    set-up, naming what its Python lacks."""
    images.test_image()
    monkeypatch.setattr(rt, "netns_nsenter", lambda: None)
    proxy = socket.create_server(("127.0.0.1", 0))
    port = proxy.getsockname()[1]
    runtime = LocalRuntime(tmp_path / "sessions", sandbox="bwrap")
    busybox = oci.busybox_image(tmp_path / "busybox")
    with pytest.raises(rt.SetupError, match="cannot run this node's proxy bridge.*ld-linux-x86-64.so.2"):
        runtime.prepare("bb~0", Workspace(), RuntimeSpec(image=str(busybox)))
    box = runtime.prepare("deb~0", Workspace(), RuntimeSpec(image=TEST_IMAGE))
    try:
        # The probe waits for the proxy's answer: the forwarder inside ends with the process it
        # serves, so a fire-and-forget send could race its exit (a harness waits for answers).
        probe = (f"import socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=30); "
                 "s.sendall(b'inside'); assert s.recv(2) == b'ok'")
        proxy.settimeout(60)

        def answer() -> bytes:
            conn, _ = proxy.accept()
            with conn:
                got = conn.recv(16)
                conn.sendall(b"ok")
                return got

        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(answer)
            r = box.run(["python3", "-c", probe], {"PATH": "/usr/bin:/bin"}, 60, "h", proxy_port=port)
            assert r.exit_code == 0 and box._bridges and not box._netns, r.output_tail   # through the bridge inside
            assert got.result(timeout=60) == b"inside"
    finally:
        box.teardown()
        proxy.close()
