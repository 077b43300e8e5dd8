"""The session sandbox (bubblewrap) as a security boundary, seen from inside a session: a
`command` harness and its evaluator try to reach a host unix socket, read the CA key, the
database and a sibling session, connect to the host and to 1.1.1.1, and leave processes
behind (`setsid env -i`, a double fork); every attempt fails and the model call through the
proxy still works. Then what a killed node leaves is removed by the next start, and a machine
without a working bwrap falls back with one warning."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from polar_mitm.rollout import bwrap as bw
from polar_mitm.rollout import images
from polar_mitm.rollout import runtime as rt
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import Workspace
from support.procs import alive, token, until
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts
from support import SUPPORT

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"

needs_bwrap = pytest.mark.skipif(bw.probe()[0] is None, reason=f"no bwrap sandbox here: {bw.probe()[1]}")


def running(cmd: str) -> list[int]:
    """Processes whose command line is exactly cmd (bwrap's own carry it inside theirs)."""
    out = []
    for pid in alive(cmd):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().replace(b"\0", b" ").decode(errors="replace").strip() == cmd:
                    out.append(pid)
        except OSError:
            pass
    return out


def written(root: Path, name: str) -> Path:
    """Where the probe wrote: the workspace (the harness), or the evaluator's own HOME in its
    fresh sandbox (kept with its session: the workspace is read-only to it)."""
    return next(root.glob(f"eval-*/home/escape-{name}.json"), root / "work" / f"escape-{name}.json")


def shown(listing) -> list:
    """A listing the sandbox showed; [] where the directory is not there at all."""
    return listing if isinstance(listing, list) else []


def host_ip() -> str:
    """This machine's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("1.1.1.1", 53))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class Listener:
    """A server socket of the node's that no session may reach; counts what reaches it."""

    def __init__(self, sock: socket.socket):
        self.sock, self.accepted = sock, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self):
        self.sock.close()


@needs_bwrap
@pytest.mark.parametrize("image", [False, True], ids=["node-root", "image-root"])
def test_a_session_and_its_evaluator_cannot_get_out_of_the_sandbox(start_proxy, tmp_path, image):
    """Also with an environment image as the session's root (the test image: its own /usr,
    /etc and a writable layer of the session's), where the same rules hold."""
    if image:
        images.test_image()      # built before the clock starts (about 80 s the first time)
    tok = token()
    # the node's own: a unix socket in the host /tmp (where vLLM's ZMQ IPC sockets live), an
    # abstract one, and a TCP port on every address
    unix_path = f"/tmp/polar-escape-{tok}.sock"
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    u.bind(unix_path)
    u.listen(8)
    a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    a.bind(f"\0polar-escape-{tok}")
    a.listen(8)
    t = socket.create_server(("0.0.0.0", 0))
    listeners = [Listener(u), Listener(a), Listener(t)]
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copy(HERE / "escape_probe.py", ws / "probe.py")
    sessions = tmp_path / "sessions"
    with FakeVLLM("scripted") as backend:
        proxy = start_proxy(backend.url)
        runtime = LocalRuntime(sessions, keep=True, sandbox="bwrap", expose=[HERE])
        sibling = sessions / "sibling~0-decoy"       # a session directory the way the node makes them
        (sibling / "work").mkdir(parents=True)
        (sibling / "work" / "secret.txt").write_text("a sibling's secret")
        (ws / "targets.json").write_text(json.dumps({
            "unix": unix_path, "abstract": f"polar-escape-{tok}", "ca_key": str(proxy.confdir / "mitmproxy-ca.pem"),
            "ca_cert": proxy.ca, "db": str(proxy.db), "sibling": str(sibling), "base": str(sessions),
            "host_ip": host_ip(), "host_port": t.getsockname()[1], "proxy_port": proxy.port}))
        rollouts = Rollouts(proxy, runtime)
        server = rollouts.server
        # sample 1 is a running sibling with a secret in its workspace; sample 0 leaves
        # processes behind that try every way out of the process tree, probes, then makes
        # a model call through the proxy
        command = textwrap.dedent(f"""\
            case "$POLAR_SESSION" in
              *~1) echo sibling-secret > secret.txt; sleep 4;;
              *) setsid env -i sleep {tok}1 &
                 ( sleep {tok}2 & ) &
                 sh -c 'setsid sh -c "sleep {tok}3 &" &'
                 nohup env -i setsid sleep {tok}4 > /dev/null 2>&1 &
                 sleep 1; {sys.executable} probe.py harness && {FAKE} ok 1;;
            esac""")
        try:
            server.submit({"task_id": "escape", "instruction": "x", "harness": "command", "num_samples": 2,
                           "timeout": 60, "workspace": str(ws), "command": command,
                           "evaluator": f"{sys.executable} probe.py evaluator && echo 1",
                           **({"runtime": {"image": rt.TEST_IMAGE, "workdir": "/workspace"}} if image else {})})
            assert until(lambda: all(running(f"sleep {tok}{i}") for i in range(1, 5)), 30), \
                "the stray processes never started"
            assert server.wait(["escape"], timeout=90)
            left = alive(f"sleep {tok}")     # at once: a run ends only once its sandbox is empty
            group = server.group("escape")
        finally:
            rollouts.stop()
            for pid in alive(f"sleep {tok}"):
                os.kill(pid, signal.SIGKILL)
            for li in listeners:
                li.close()
            os.unlink(unix_path)
    assert not left, f"processes outlived their session: {left}"
    s0 = next(s for s in group["sessions"] if s["session_id"] == "escape~0")
    assert s0["state"] == "done" and s0["reward"] == 1.0, s0
    assert s0["stats"]["calls"] == 1 and s0["stats"]["network"] == "isolated"   # the proxy works
    (root,) = sessions.glob("escape-0-*")
    (sib,) = sessions.glob("escape-1-*")
    assert (sib / "work" / "secret.txt").read_text() == "sibling-secret\n"      # it was there
    for name in ("harness", "evaluator"):
        got = json.loads(written(root, name).read_text())
        report = json.dumps(got, indent=1)
        print(name, report)
        # in an image, / is the session's own layer over the image: its /etc/shadow is the
        # image's (no secret of the node's), and what it writes there stays in that layer
        own = ("/etc/shadow", "write /usr", "write /") if image else ()
        attempts = {k: v for k, v in got.items() if isinstance(v, str) and k not in ("proxy", "CA cert", *own)}
        assert attempts and all(v.startswith("blocked") for v in attempts.values()), report
        if image:
            rootfs = runtime.images.lease(str(images.test_image())).image.rootfs
            assert got["/etc/shadow"] == f"ESCAPED: {(rootfs / 'etc/shadow').read_bytes()[:40]!r}", report
            assert not (rootfs / "usr/polar-escape").exists() and not (rootfs / "polar-escape").exists()
            assert not Path("/usr/polar-escape").exists() and not Path("/polar-escape").exists()
        # no route: its own network namespace, not a firewall's refusal
        for k in ("TCP to the host's address", "TCP to 1.1.1.1:443", "TCP to 1.1.1.1:53"):
            assert got[k] == "blocked: ENETUNREACH", report
        assert got["running sibling's file"] == [], report
        assert got["ls sessions"] == [root.name], report                      # no sibling, no lock
        assert shown(got["ls CA dir"]) in ([], ["mitmproxy-ca-cert.pem"]), report   # the certificate only
        assert proxy.db.name not in shown(got["ls database dir"]), report
        assert f"polar-escape-{tok}.sock" not in shown(got["ls /tmp"]), report
        image_run = sorted(os.listdir(runtime.images.lease(str(images.test_image())).image.rootfs / "run")) \
            if image else []
        assert sorted(set(shown(got["ls /run"])) - set(image_run)) in ([], ["polar"]), report   # no host sockets
        assert not any(x in p for p in got["processes"] for x in ("-m pytest", "mitmdump", "janitor")), report
        assert len(got["processes"]) < 20, report                               # its own PID namespace
    harness = json.loads(written(root, "harness").read_text())
    evaluator = json.loads(written(root, "evaluator").read_text())
    assert harness["proxy"] == "ESCAPED: 'connected'"       # its one way out, to the proxy
    assert harness["CA cert"].startswith("ESCAPED: b'-----BEGIN CERTIFICATE")
    assert evaluator["proxy"].startswith("blocked")         # the evaluator has none
    assert [li.accepted for li in listeners] == [0, 0, 0]


@needs_bwrap
def test_processes_that_leave_the_tree_end_with_the_run_at_once(tmp_path):
    """A run returns once its sandbox is empty: nothing to find afterwards, no wait for it
    (the environment marks of the fallback made each teardown wait 5 s on `env -i`)."""
    tok = token()
    box = LocalRuntime(tmp_path / "s", sandbox="bwrap").prepare("t~0", Workspace())
    env = {"PATH": os.environ["PATH"]}
    strays = (f"setsid env -i sleep {tok}1 & ( sleep {tok}2 & ) & "
              f"sh -c 'setsid sh -c \"sleep {tok}3 &\" &'; nohup env -i setsid sleep {tok}4 >/dev/null 2>&1 & ")
    t0 = time.monotonic()
    r = box.run(["/bin/sh", "-c", strays + f"sleep 0.5; echo started $(pgrep -xfc 'sleep {tok}.')"], env, 30, "h")
    assert r.exit_code == 0 and "started 4" in r.output_tail, r      # all four ran
    assert alive(f"sleep {tok}") == [] and time.monotonic() - t0 < 5
    # killed at its timeout, with strays
    r = box.run(["/bin/sh", "-c", strays + "exec sleep 600"], env, 1.5, "h")
    assert r.timed_out and r.seconds < 5 and alive(f"sleep {tok}") == [], r
    # cancelled from another thread
    threading.Timer(1.0, box.cancel).start()
    r = box.run(["/bin/sh", "-c", strays + "exec sleep 600"], env, 60, "h")
    assert r.cancelled and r.seconds < 5 and alive(f"sleep {tok}") == [], r
    t0 = time.monotonic()
    box.teardown()
    assert time.monotonic() - t0 < 1 and not box.root.exists()


@needs_bwrap
def test_what_a_killed_node_left_is_removed_by_the_next_start(tmp_path):
    tok = token()
    base = tmp_path / "sessions"
    proxy = socket.create_server(("127.0.0.1", 0))
    code = textwrap.dedent(f"""
        import os, threading, time
        from polar_mitm.rollout.runtime import LocalRuntime
        from polar_mitm.rollout.spec import Workspace
        box = LocalRuntime({str(base)!r}, sandbox="bwrap").prepare("t~0", Workspace())
        argv = ["/bin/sh", "-c", "setsid env -i sleep {tok}1 & exec sleep {tok}2"]
        threading.Thread(target=box.run, args=(argv, {{"PATH": os.environ["PATH"]}}, 600, "h"),
                         kwargs={{"proxy_port": {proxy.getsockname()[1]}}}, daemon=True).start()
        for _ in range(600):   # the bridge: a proxy socket's directory, or a namespace the node made
            if box._bridges or box._netns:
                break
            time.sleep(0.05)
        print(box._bridges[0][1] if box._bridges else "-", flush=True)
        time.sleep(600)
    """)
    node = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = node.stdout.readline().strip()
        assert line, "the node made no bridge"
        bridge = Path(line) if line != "-" else None    # None: the namespace the node made, gone with it
        assert until(lambda: running(f"sleep {tok}1") and running(f"sleep {tok}2"), 10), alive(f"sleep {tok}")
        (left,) = [p for p in base.iterdir() if p.is_dir()]
        node.send_signal(signal.SIGKILL)
        node.wait()
        # its sandbox went with it (PDEATHSIG on bwrap, bwrap's on its PID 1)...
        assert until(lambda: not alive(f"sleep {tok}"), 10), alive(f"sleep {tok}")
        # ...its files stayed, and the next start on the same directory removes them
        assert left.exists() and (bridge is None or (bridge / "proxy.sock").exists()), (list(base.iterdir()), bridge)
        live = LocalRuntime(tmp_path / "live", sandbox="bwrap").prepare("live~0", Workspace())
        live.run(["true"], {}, 10, "h", proxy_port=proxy.getsockname()[1])   # a live node's bridge
        live_bridges = [d for _, d in live._bridges]
        LocalRuntime(base, sandbox="bwrap")
        assert not left.exists() and not (bridge and bridge.exists()), (list(base.iterdir()), bridge)
        assert all(Path(d).exists() for d in live_bridges), live_bridges   # a live node's are left alone
        # a runtime finds the directory held while another runtime or one of its sandboxes lives
        box = LocalRuntime(base, sandbox="bwrap").prepare("t~1", Workspace())
        LocalRuntime(base, sandbox="bwrap")
        assert box.root.exists()
        box.teardown()
        live.teardown()
    finally:
        if node.poll() is None:
            node.kill()
        for pid in alive(f"sleep {tok}"):
            os.kill(pid, signal.SIGKILL)
        proxy.close()


@pytest.fixture
def fresh_probe():
    rt.unshare_argv()          # known before PATH loses it: cached for the tests that follow
    bw.probe.cache_clear()
    rt._warned.clear()
    yield
    bw.probe.cache_clear()
    rt._warned.clear()


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_without_a_working_bwrap_the_node_warns_once_and_falls_back(how, fresh_probe, tmp_path, monkeypatch, caplog):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if how == "broken":   # as where user namespaces or mounts are not allowed
        fake = bin_dir / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/nonexistent")
    with caplog.at_level(logging.WARNING, logger="polar.sandbox"):
        first = LocalRuntime(tmp_path / "a")
        second = LocalRuntime(tmp_path / "b")
    assert first.sandbox == second.sandbox == "local" and first.bwrap is None
    warnings = [r.getMessage() for r in caplog.records if "WITHOUT the bwrap sandbox" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert ("not installed" if how == "missing" else "Operation not permitted") in warnings[0]
    with pytest.raises(RuntimeError, match="bwrap sandbox was asked for"):
        LocalRuntime(tmp_path / "c", sandbox="bwrap")
    # the fallback still runs sessions (today's sandbox: a marked process group)
    box = first.prepare("t~0", Workspace())
    r = box.run(["/bin/sh", "-c", "echo hi"], {"PATH": "/usr/bin:/bin"}, 10, "h")
    assert r.exit_code == 0 and "hi" in r.output_tail and box.kind == "local"
    box.teardown()


@needs_bwrap
def test_an_exposed_directory_still_hides_the_other_sessions_and_the_ca_key(tmp_path):
    """POLAR_SANDBOX_EXPOSE-style paths are shown read-only, but never the sessions' directory
    or the CA key beside the certificate, even when they lie under one."""
    conf = tmp_path / "mitmproxy"
    conf.mkdir()
    (conf / "mitmproxy-ca.pem").write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    (conf / "mitmproxy-ca-cert.pem").write_text("-----BEGIN CERTIFICATE-----\ncert\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "grader.sh").write_text("echo graded\n")
    runtime = LocalRuntime(tmp_path / "sessions", sandbox="bwrap", expose=[tmp_path])
    other = runtime.prepare("other~0", Workspace())
    box = runtime.prepare("t~0", Workspace())
    env = {"PATH": "/usr/bin:/bin", "SSL_CERT_FILE": str(conf / "mitmproxy-ca-cert.pem")}
    r = box.run(["/bin/sh", "-c", f"sh {tmp_path}/tools/grader.sh; echo sessions: $(ls {tmp_path / 'sessions'}); "
                 f"echo conf: $(ls {conf}); cat {conf}/mitmproxy-ca-cert.pem; cat {conf}/mitmproxy-ca.pem; "
                 f"touch {tmp_path}/tools/x || echo read-only"], env, 30, "h")
    out = r.output_tail
    assert "graded" in out and "read-only" in out, out                     # exposed, read-only
    assert f"sessions: {box.root.name}\n" in out, out                      # no other session
    assert "conf: mitmproxy-ca-cert.pem\n" in out and "cert" in out and "secret" not in out, out
    # a certificate file that holds a key is not shown at all
    r = box.run(["/bin/sh", "-c", f"cat {conf}/mitmproxy-ca.pem || echo hidden"],
                {**env, "SSL_CERT_FILE": str(conf / "mitmproxy-ca.pem")}, 30, "h")
    assert "hidden" in r.output_tail and "secret" not in r.output_tail, r.output_tail
    other.teardown()
    box.teardown()
