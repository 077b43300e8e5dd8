"""The vLLM stand-in as a server process (a Ray replica actor's, in the cluster tests):
dev mode, the token route, pulls fetched and checked; serves until killed.

    python fake_vllm_server.py [--delay S] [--reload-delay S] --host H --port P"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.fake_vllm import FakeVLLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.01)
    ap.add_argument("--reload-delay", type=float, default=0.0)
    args = ap.parse_args()
    fake = FakeVLLM(delay=args.delay, reload_delay=args.reload_delay, listen=False)
    fake.fetch_pulls = True
    fake.port = args.port
    fake.url = f"http://{args.host}:{args.port}"
    fake.up()
    threading.Event().wait()


if __name__ == "__main__":
    main()
