"""scripts/gpu_check.py is for a bare GPU machine no test reaches; its --smoke mode runs the
same code at toy sizes on this CPU, so the script is known to run before it is carried there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_its_code_at_toy_sizes():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--smoke"],
                         capture_output=True, text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "",
                                                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the CPU reference ran" in out.stdout
    lines = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines() if ln.startswith(("trie ", "per_request "))}
    trie, per_request = (int(lines[b][1].replace(",", "")) for b in ("trie", "per_request"))
    assert 0 < trie < per_request    # the trie runs the shared prefix once
