"""What the proxy adds to a model call, measured side by side in one run.

A stand-in backend answers instantly, so every millisecond measured is the proxy's own
(translation, the backend round trip, the DuckDB group commit before the answer).

    .venv/bin/python scripts/bench_gateway.py [--calls 50] [--clients 16]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_vllm import FakeVLLM  # noqa: E402

from polar_mitm import launch  # noqa: E402
from polar_mitm.store import query  # noqa: E402

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 8}


def timed_calls(url: str, n: int, key: str) -> list[float]:
    out = []
    with httpx.Client(trust_env=False, timeout=60) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post(url, json=BODY, headers={"authorization": f"Bearer {key}"})
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1000)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    with FakeVLLM() as fake:
        proxy = launch.start_proxy(db=work / "bench.duckdb", backend=fake.url, port=launch.free_port(),
                                   confdir=work / "conf", log_path=work / "mitmdump.log",
                                   reverse_port=(rp := launch.free_port()))
        try:
            via = f"http://127.0.0.1:{rp}/v1/chat/completions"
            timed_calls(via, 3, "polar-warmup")
            direct = timed_calls(fake.url + "/v1/chat/completions", args.calls, "x")
            proxied = timed_calls(via, args.calls, "polar-bench~serial")
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                list(pool.map(lambda i: timed_calls(via, args.calls // 2 or 1, f"polar-bench~c{i}"),
                              range(args.clients)))
            wall = time.perf_counter() - t0
            parallel_calls = args.clients * (args.calls // 2 or 1)
        finally:
            proxy.stop()
    d, p = statistics.median(direct), statistics.median(proxied)
    print(f"median latency direct to backend : {d:8.2f} ms")
    print(f"median latency through the proxy : {p:8.2f} ms   (x{p / d:.1f}, +{p - d:.1f} ms per call, "
          f"record committed before the answer)")
    serial_rate = 1000 / p
    rate = parallel_calls / wall
    print(f"throughput, 1 client             : {serial_rate:8.1f} calls/s")
    print(f"throughput, {args.clients} clients           : {rate:8.1f} calls/s   "
          f"(x{rate / serial_rate:.1f}: group commit shares one transaction among waiting calls)")
    rows = query(work / "bench.duckdb", "SELECT count(*) FROM calls")[1][0][0]
    print(f"rows recorded                    : {rows:8d}   (every call)")


if __name__ == "__main__":
    main()
