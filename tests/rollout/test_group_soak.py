"""GRPO groups under faults, a short run of scripts/soak_groups.py (its full run: 20 kill -9
and 20 triple SIGINTs): `polar-mitm rollout` killed -9 at a random moment, or interrupted
three times, then rerun to the end; no group ever holds more rewarded sessions than samples,
and no sample is lost for good."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from soak_groups import soak  # noqa: E402


def test_groups_hold_under_kill_9_and_repeated_interrupts(tmp_path):
    report = soak(kills=2, interrupts=1, seed=7, work=tmp_path)
    assert report["trials"] == 3 and report["kills"] == 2 and report["interrupts"] == 3
    assert report["problems"] == []
    assert report["sessions"].get("done") == 3 * 12     # every sample of every trial, once
