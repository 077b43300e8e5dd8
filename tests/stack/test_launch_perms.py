"""What the proxy writes (its log, the CA files in its confdir, the database, its WAL and
call log) is readable by its own user only, whatever the launching shell's umask."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx

from support.fake_vllm import FakeVLLM
from polar_mitm.stack import launch


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_open_private_log_narrows_an_old_log(tmp_path):
    old = tmp_path / "logs" / "vllm.log"
    old.parent.mkdir()
    old.write_text("earlier run\n")
    old.chmod(0o644)
    with launch.open_private_log(old) as f:
        f.write(b"more\n")
    assert mode(old) == 0o600 and old.read_text() == "earlier run\nmore\n"
    fresh = tmp_path / "new" / "dir" / "x.log"
    launch.open_private_log(fresh).close()
    assert mode(fresh) == 0o600 and mode(fresh.parent) == 0o700


def test_service_log_and_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        log = tmp_path / "svc.log"
        svc = launch.Service("umask", [sys.executable, "-c", "import os; print(oct(os.umask(0)))"],
                             log_path=log, umask=launch.PRIVATE_UMASK)
        svc.proc.wait(30)
        assert log.read_text().strip() == "0o77" and mode(log) == 0o600
        plain = launch.Service("plain", [sys.executable, "-c", "import os; print(oct(os.umask(0)))"],
                               log_path=tmp_path / "plain.log")
        plain.proc.wait(30)
        assert (tmp_path / "plain.log").read_text().strip() == "0o22"   # others keep theirs
    finally:
        os.umask(previous)


def test_proxy_files_are_private(tmp_path):
    previous = os.umask(0o022)   # a typical login shell: files 0644, dirs 0755
    try:
        db = tmp_path / "data" / "calls.duckdb"
        confdir = tmp_path / "conf"
        log = tmp_path / "logs" / "mitmdump.log"
        port, rport = launch.free_ports(2)
        with FakeVLLM() as fake:
            proxy = launch.start_proxy(db=db, backend=fake.url, port=port, confdir=confdir,
                                       log_path=log, reverse_port=rport)
            try:
                r = httpx.post(f"http://127.0.0.1:{rport}/v1/chat/completions", trust_env=False, timeout=30,
                               headers={"authorization": "Bearer polar-perm~1"},
                               json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200
                status = Path(f"/proc/{proxy.proc.pid}/status")
                if status.exists():   # Linux: what everything the proxy creates gets
                    umask = next(line.split()[1] for line in status.read_text().splitlines()
                                 if line.startswith("Umask:"))
                    assert int(umask, 8) == 0o077
            finally:
                proxy.stop()
    finally:
        os.umask(previous)
    assert mode(log) == 0o600 and mode(log.parent) == 0o700
    assert mode(confdir) == 0o700
    made = [p for p in confdir.rglob("*")]
    assert any(p.name == "mitmproxy-ca.pem" for p in made)
    assert all(mode(p) == (0o700 if p.is_dir() else 0o600) for p in made), \
        {p.name: oct(mode(p)) for p in made}
    assert mode(db) == 0o600 and mode(db.parent) == 0o700
    for p in tmp_path.joinpath("data").rglob("*"):   # WAL, call log, reader requests
        assert mode(p) & 0o077 == 0, (p, oct(mode(p)))
    # the harness (same user) still reads the CA certificate it is pointed at
    assert subprocess.run(["cat", str(confdir / "mitmproxy-ca-cert.pem")], capture_output=True).returncode == 0


def test_free_ports_are_distinct():
    """Picked one at a time, two ports can collide (the kernel reuses a just-closed one), and
    mitmdump then refuses to start: 'Cannot spawn multiple servers on the same address'. The
    demo picks vLLM's port after the proxy's, so later picks must not repeat earlier ones."""
    for _ in range(200):
        ports = launch.free_ports(4)
        assert len(set(ports)) == 4
    singles = [launch.free_port() for _ in range(300)]
    assert len(set(singles)) == 300


def test_a_services_log_stays_bounded_while_it_runs(tmp_path, monkeypatch):
    """A long run's proxy logs every flow: past the cap its log moves to LOG.1 and starts
    again, while the child goes on writing to the file it holds open."""
    import time
    monkeypatch.setattr(launch, "LOG_CHECK_S", 0.05)
    log = tmp_path / "svc.log"
    writer = "import sys, time\nfor i in range(4000):\n    print(f'line {i:05d} ' + 'x' * 90, flush=True)\n" \
             "    time.sleep(0.0005)\n"
    svc = launch.Service("writer", [sys.executable, "-c", writer], log_path=log, log_max_bytes=50_000)
    try:
        svc.proc.wait(60)
    finally:
        svc.stop()
    time.sleep(0.2)
    old = log.with_name("svc.log.1")
    assert old.exists() and old.stat().st_size > 50_000
    assert log.stat().st_size < 400_000            # 4000 lines of 100 bytes, capped at least once
    assert oct(old.stat().st_mode & 0o777) == "0o600"
    last = log.read_text().splitlines()
    assert last and last[-1].startswith("line 03999")   # the child's writes go on at the new start
    assert "\0" not in log.read_text()                  # O_APPEND: no hole where the old end was
