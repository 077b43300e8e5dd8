"""kill -9 soak: the real proxy is killed at random moments while calls are in flight and
restarted on the same database and ports. Every call a client got a 200 for must be in the
database exactly once afterwards (the proxy acknowledges only after a durable append to its
call log); calls that failed may be there at most once; no session reuses a seq number.

Seeded, so each run kills at the same offsets; the assertions hold whatever the timing, and
the test checks that its kills really landed on calls in flight and on acknowledged calls
the loader had not moved into DuckDB yet."""

from __future__ import annotations

import random
import re
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

from support.fake_vllm import FakeVLLM
from polar_mitm.stack import launch
from polar_mitm.store import connect, query

NONCE = re.compile(r"nonce-[0-9a-f]{20}")
# A long, constant system prompt: later turns of a session are stored as deltas against
# earlier ones, so a kill also lands between a base call and the calls that refer to it.
SYSTEM = "You are a careful assistant; answer briefly. " * 30


class Soak:
    def __init__(self, root: Path, backend: str, clients: int):
        self.root, self.backend = root, backend
        self.db = root / "soak.duckdb"
        self.port, self.reverse_port = launch.free_ports(2)
        self.clients = clients
        self.lock = threading.Lock()
        self.attempted: dict[str, str] = {}   # nonce -> session key, every call sent
        self.acked: dict[str, str] = {}       # nonce -> session key, calls answered 200
        self.inflight = 0
        self.failed = 0
        self.stop = threading.Event()
        self.service: launch.Service | None = None
        self.starts = 0

    # ---- the proxy -------------------------------------------------------------------

    def start(self) -> None:
        try:
            self.service = self._start()
        except (RuntimeError, TimeoutError):
            # the old ports still held somewhere: new ones (clients read them per call)
            self.port, self.reverse_port = launch.free_ports(2)
            self.service = self._start()
        self.starts += 1

    def _start(self) -> launch.Service:
        return launch.start_proxy(db=self.db, backend=self.backend, port=self.port,
                                  confdir=self.root / "conf", log_path=self.root / "mitmdump.log",
                                  reverse_port=self.reverse_port)

    def kill(self) -> int:
        """SIGKILL the proxy once calls are in flight; returns how many were."""
        deadline = time.monotonic() + 5
        while self.inflight == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        inflight = self.inflight
        self.service.kill()
        return inflight

    # ---- the harnesses ---------------------------------------------------------------

    def client(self, idx: int) -> None:
        key = f"polar-soak~{idx}"
        history: list[dict] = []
        with httpx.Client(timeout=20, trust_env=False) as http:
            while not self.stop.is_set():
                nonce = f"nonce-{uuid.uuid4().hex[:20]}"
                turn = {"role": "user", "content": f"turn {len(history) // 2}: repeat {nonce}"}
                body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, *history, turn]}
                with self.lock:
                    self.attempted[nonce] = key
                    self.inflight += 1
                ok = False
                try:
                    r = http.post(f"http://127.0.0.1:{self.reverse_port}/v1/chat/completions",
                                  json=body, headers={"authorization": f"Bearer {key}"})
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    pass
                finally:
                    with self.lock:
                        self.inflight -= 1
                        if ok:
                            self.acked[nonce] = key
                        else:
                            self.failed += 1
                if ok:   # the conversation goes on, as a harness's would
                    history += [turn, {"role": "assistant", "content": "ok"}]
                    if len(history) > 24:
                        history = []
                else:
                    time.sleep(0.05)   # the proxy is down or restarting

    def run_clients(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in threads:
            t.start()
        return threads

    def wait_for_acks(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        target = len(self.acked) + n
        while len(self.acked) < target and time.monotonic() < deadline:
            time.sleep(0.01)


def unloaded_lines(db: Path) -> int:
    """Acknowledged lines of the (dead) proxy's call log that are not in DuckDB yet."""
    from polar_mitm.store.calllog import Position, log_dir, read_lines
    from polar_mitm.store.load_batch import POSITION_KEY

    con = connect(db, read_only=True, timeout=10)
    try:
        row = con.execute("SELECT value FROM meta WHERE key = ?", [POSITION_KEY]).fetchone()
    finally:
        con.close()
    return len(read_lines(log_dir(db), Position.decode(row[0] if row else None))[0])


def stored_calls(db: Path) -> list[tuple[str, int, int, str | None]]:
    """(session_id, seq, status_code, nonce of the call's own last message) of every call."""
    columns = query(db, "SELECT * FROM calls LIMIT 0")[0]
    text = "request_text" if "request_text" in columns else "request_json::VARCHAR"
    rows = query(db, f"SELECT session_id, seq, status_code, {text} FROM calls")[1]
    out = []
    for sid, seq, status, body in rows:
        found = NONCE.findall(body or "")
        out.append((sid, seq, status, found[-1] if found else None))   # the last turn is its own
    return out


def check_store(soak: Soak) -> None:
    rows = stored_calls(soak.db)
    per_nonce = Counter(n for *_, n in rows)
    assert soak.acked, "no call was acknowledged"
    missing = [n for n in soak.acked if per_nonce[n] == 0]
    assert not missing, f"{len(missing)} of {len(soak.acked)} acknowledged calls are not in the database"
    twice = {n: c for n, c in per_nonce.items() if c > 1}
    assert not twice, f"calls stored more than once: {list(twice.items())[:5]}"
    assert None not in per_nonce, "a stored call has no nonce"
    assert set(per_nonce) <= set(soak.attempted)
    status = {n: s for _, _, s, n in rows}
    assert all(status[n] == 200 for n in soak.acked)
    seqs = Counter((sid, seq) for sid, seq, *_ in rows)
    assert all(c == 1 for c in seqs.values()), [k for k, c in seqs.items() if c > 1][:5]
    assert len({sid for sid, *_ in rows}) == soak.clients


def test_kill_9_loses_no_acknowledged_call(tmp_path):
    rng = random.Random(20261203)
    kills = []
    with FakeVLLM(delay=0.03) as fake:   # every call spends a while in flight
        soak = Soak(tmp_path, fake.url, clients=4)
        soak.start()
        threads = soak.run_clients()
        try:
            for _ in range(6):
                soak.wait_for_acks(rng.randint(5, 40))
                time.sleep(rng.uniform(0.0, 0.4))
                inflight = soak.kill()
                kills.append((inflight, unloaded_lines(soak.db)))
                soak.start()
            soak.wait_for_acks(20)
            # the last kill is not followed by a proxy: the reader itself loads the orphaned log
            inflight = soak.kill()
            kills.append((inflight, unloaded_lines(soak.db)))
        finally:
            soak.stop.set()
            for t in threads:
                t.join(30)
            soak.service.stop()
    assert all(inflight > 0 for inflight, _ in kills), kills       # every kill hit calls in flight
    assert soak.failed >= len(kills)                                # ... and cut some of them off
    assert sum(1 for _, unloaded in kills if unloaded) >= 2, kills  # acknowledged, not loaded yet
    check_store(soak)
    assert len(soak.acked) >= 50


def test_kill_9_under_load_with_a_reader_running(tmp_path):
    """More clients, no backend delay, and a reader in a loop: a read must see at least
    every call acknowledged before it began (the loader loads the log first, or the reader
    itself when no proxy is alive, also when it died during the read's wait). A read during
    which the proxy was killed and restarted may still connect between the new proxy's
    start and its first load, and miss some; those are counted, not failed, here."""
    rng = random.Random(14)
    kills, kill_times, reads, stale, errors = [], [], [], [], []

    def reader():
        while not soak.stop.is_set():
            with soak.lock:
                acked_before = len(soak.acked)
            t0 = time.monotonic()
            try:
                count = query(soak.db, "SELECT count(*) FROM calls", timeout=20)[1][0][0]
            except Exception as e:   # noqa: BLE001  (asserted below, not swallowed)
                errors.append(repr(e))
                continue
            reads.append((t0, time.monotonic()))
            if count < acked_before:
                stale.append((t0, time.monotonic(), count, acked_before))
            time.sleep(0.05)

    def kill():
        before = time.monotonic()
        kills.append(soak.kill())
        kill_times.append((before, time.monotonic()))

    with FakeVLLM() as fake:
        soak = Soak(tmp_path, fake.url, clients=8)
        soak.start()
        threads = soak.run_clients()
        reading = threading.Thread(target=reader, daemon=True)
        reading.start()
        try:
            for _ in range(5):
                soak.wait_for_acks(rng.randint(20, 80))
                time.sleep(rng.uniform(0.0, 0.3))
                kill()
                time.sleep(rng.uniform(0.0, 0.3))   # the reader may catch up meanwhile
                soak.start()
            soak.wait_for_acks(40)
            kill()
        finally:
            soak.stop.set()
            for t in [*threads, reading]:
                t.join(30)
            soak.service.stop()
    assert all(k > 0 for k in kills), kills
    assert not errors, errors[:3]
    assert len(reads) >= 5, (reads, stale)
    straddled = [r for r in stale if any(r[0] <= after and before <= r[1] for before, after in kill_times)]
    unexplained = [r[2:] for r in stale if r not in straddled]
    assert not unexplained, f"reads that missed acknowledged calls (count, acked before): {unexplained[:5]}"
    check_store(soak)
