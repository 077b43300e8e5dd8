"""The driver's Collector and the node's NodeShipper (cluster/shipping.py), with no Ray: every
node's calls reach the driver's database exactly once, across a re-sent chunk, a driver killed
(between load and ack, and -9 at a random moment), a node restarted, and a node that fails."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from polar_mitm.cluster.shipping import CallableSource, Collector, NodeShipper
from polar_mitm.store import CallRecord, CallWriter, SessionInfo, init_db, log_dir, query
from polar_mitm.store.calllog import Position, log_end
from polar_mitm.store.shipping import load_chunk, shipped_position

ROOT = Path(__file__).resolve().parents[2]


def rec(i: int) -> CallRecord:
    return CallRecord(f"c{i}", style="openai_chat", request_text=f'{{"i":{i},"pad":"{"x" * 300}"}}',
                      prompt_token_ids=[1, 2, 3], token_ids=[4, i], logprobs=[-0.5, -0.25],
                      started_at=1_700_000_000 + i, status_code=200)


def record(writer: CallWriter, ids: range) -> list[str]:
    futs = [writer.submit(SessionInfo(f"t{i % 5}~{i % 3}", task_id=f"t{i % 5}"), rec(i)) for i in ids]
    [f.result(30) for f in futs]
    return [f"c{i}" for i in ids]


def recorded(db: Path, ids: range) -> list[str]:
    w = CallWriter(db).start()
    try:
        return record(w, ids)
    finally:
        w.close()


def stored(db: Path) -> list[str]:
    ids = [r[0] for r in query(db, "SELECT call_id FROM call_records")[1]]
    assert len(ids) == len(set(ids)), "a call stored twice"
    return sorted(ids)


def calls(db: Path) -> list[tuple]:
    return query(db, "SELECT * FROM calls ORDER BY call_id")[1]


def test_two_nodes_ship_every_call_once_and_the_driver_reads_them_as_they_do(tmp_path):
    a, b, driver = tmp_path / "a.duckdb", tmp_path / "b.duckdb", tmp_path / "driver.duckdb"
    ship_a, ship_b = NodeShipper(a), NodeShipper(b)
    ids = recorded(a, range(0, 150)) + recorded(b, range(1000, 1120))
    with Collector(driver, interval=0.05, max_bytes=8192) as c:
        c.add("a", ship_a)
        c.add("b", ship_b)
        assert c.catch_up(30)
        stats = c.stats()
    assert stored(driver) == sorted(ids)
    assert calls(driver) == sorted(calls(a) + calls(b))
    assert stats["a"].lines == 150 and stats["b"].lines == 120 and stats["a"].chunks > 3
    assert stats["a"].bytes == log_end(log_dir(a)).offset and stats["a"].seconds > 0
    assert ship_a.shipped() == log_end(log_dir(a)) and ship_a.wait_shipped(0)


def test_catch_up_returns_once_the_lines_present_when_called_are_in(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    shipper = NodeShipper(node)
    w = CallWriter(node).start()
    gate = threading.Event()
    gate.set()

    def read(start, max_bytes):
        assert gate.wait(30)
        return shipper.read(start, max_bytes)

    try:
        # rounds an hour apart: only catch_up makes one come now
        with Collector(driver, interval=3600) as c:
            c.add("node", CallableSource(shipper.log_id, read, shipper.ack))
            assert c.catch_up(30)
            first = record(w, range(40))
            assert stored(driver) == []            # no round since
            assert c.catch_up(30)
            assert stored(driver) == sorted(first)  # at once when it returns
            gate.clear()                            # the node is slow to answer
            more = record(w, range(40, 60))
            assert not c.catch_up(0.3)
            gate.set()
            assert c.catch_up(30)
            assert stored(driver) == sorted(first + more)
    finally:
        gate.set()
        w.close()


def test_a_failing_node_is_marked_down_and_never_holds_up_another(tmp_path):
    good, bad_db, driver = tmp_path / "good.duckdb", tmp_path / "bad.duckdb", tmp_path / "driver.duckdb"
    healthy, flaky = NodeShipper(good), NodeShipper(bad_db)
    ids = recorded(good, range(50))
    later = recorded(bad_db, range(500, 530))
    broken = threading.Event()
    broken.set()

    def read(start, max_bytes):
        if broken.is_set():
            raise ConnectionError("the node is gone")
        return flaky.read(start, max_bytes)

    with Collector(driver, interval=0.05, retry_max=0.2) as c:
        c.add("bad", CallableSource(flaky.log_id, read, flaky.ack))
        c.add("good", healthy)
        assert c.catch_up(30)
        assert stored(driver) == sorted(ids)
        assert c.down() == ["bad"]
        assert "the node is gone" in (c.stats()["bad"].last_error or "")
        broken.clear()                 # it comes back: retried, and shipped
        assert c.catch_up(30) and c.down() == []
        assert stored(driver) == sorted(ids + later)


def test_a_driver_killed_between_load_and_ack_loads_nothing_twice(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    shipper = NodeShipper(node)
    ids = recorded(node, range(80))
    init_db(driver)
    chunk = shipper.read(Position(), 1 << 20)
    load_chunk(driver, chunk)          # committed; the driver dies before the ack
    assert shipper.shipped() is None and not shipper.wait_shipped(0.05)
    with Collector(driver, interval=0.05) as c:   # the rerun driver
        c.add("node", NodeShipper(node))
        assert c.catch_up(30)
        assert shipper.wait_shipped(30)   # it acknowledged what the dead one had loaded
        assert c.stats()["node"].lines == 0
    assert stored(driver) == sorted(ids)
    assert calls(driver) == calls(node)


def test_a_node_restarted_on_its_disk_goes_on_where_the_driver_is(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    first = NodeShipper(node)
    ids = recorded(node, range(60))
    with Collector(driver, interval=0.05) as c:
        c.add("node", first)
        assert c.catch_up(30)
        # the node's process dies and comes back on the same disk, with more calls
        again = NodeShipper(node)
        assert again.log_id() == first.log_id()
        ids += recorded(node, range(60, 100))
        c.add("node", again)          # the restarted actor replaces the old one
        assert c.catch_up(30)
        assert again.wait_shipped(30)
    assert stored(driver) == sorted(ids)
    assert shipped_position(driver, first.log_id()) == log_end(log_dir(node))


def test_wait_shipped_blocks_until_the_driver_has_what_was_there(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    shipper = NodeShipper(node)
    w = CallWriter(node).start()
    try:
        record(w, range(30))
        assert not shipper.wait_shipped(0.1)   # no driver
        with Collector(driver, interval=3600) as c:
            c.add("node", shipper)
            assert shipper.wait_shipped(30)    # the collector's first round, acked
            record(w, range(30, 35))
            assert not shipper.wait_shipped(0.1)
            assert c.catch_up(30) and shipper.wait_shipped(5)
    finally:
        w.close()
    assert len(stored(driver)) == 35


KILLED_DRIVER = """
import sys
sys.path.insert(0, {root!r})
from polar_mitm.cluster.shipping import CallableSource, Collector, NodeShipper
node, driver = sys.argv[1], sys.argv[2]
shipper = NodeShipper(node)

def read(start, max_bytes):
    print("r", flush=True)   # the parent kills us a random while after some of these
    return shipper.read(start, max_bytes)

with Collector(driver, interval=0.01, max_bytes=6000) as c:
    c.add("node", CallableSource(shipper.log_id, read, shipper.ack))
    assert c.catch_up(120)
print("done", flush=True)
"""


def test_a_driver_killed_9_at_random_moments_stores_every_call_once(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    NodeShipper(node)
    ids = recorded(node, range(300))
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(KILLED_DRIVER.format(root=str(ROOT))))
    rng = random.Random(43)
    kills, partial = 0, 0

    def run(kill_after: int | None) -> bool:
        """One driver run, killed -9 a random moment after its kill_after-th read; True
        when it finished first."""
        nonlocal kills, partial
        p = subprocess.Popen([sys.executable, str(script), str(node), str(driver)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert p.stdout is not None and p.stderr is not None
        reads = 0
        for line in p.stdout:
            reads += line.strip() == "r"
            if kill_after is not None and reads >= kill_after:
                time.sleep(rng.uniform(0, 0.04))   # a random moment: in a read, a load or an ack
                p.send_signal(signal.SIGKILL)
                break
        p.wait(60)
        if p.returncode == -signal.SIGKILL:
            kills += 1
            n = len(stored(driver))       # no duplicate, whenever it died
            partial += 0 < n < len(ids)
            return False
        assert p.returncode == 0, p.stderr.read()[-2000:]
        return True

    for _ in range(5):
        if run(kill_after=rng.randint(1, 6)):
            break
    assert run(kill_after=None)
    assert kills >= 3 and partial >= 2, (kills, partial)
    assert stored(driver) == sorted(ids)
    assert calls(driver) == calls(node)
    assert NodeShipper(node).wait_shipped(0)
