"""scripts/gpu_check.py is for a bare GPU machine no test reaches; its --smoke mode runs the
same code at toy sizes on this CPU, so the script is known to run before it is carried there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_code_at_toy_sizes():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--smoke"],
                         capture_output=True, text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "",
                                                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the CPU reference ran" in out.stdout
    rows = [ln.split() for ln in out.stdout.splitlines()]
    lines = {r[0]: r for r in rows if len(r) > 1 and r[0] in ("trie", "prefix_merging", "per_request")
             and r[1].replace(",", "").isdigit()}
    trie, merged, per_request = (int(lines[b][1].replace(",", "")) for b in ("trie", "prefix_merging", "per_request"))
    assert 0 < trie < merged < per_request    # the trie runs the shared prefix once
    flops = {b: float(lines[b][2].replace(",", "")) for b in lines}
    assert 0 < flops["trie"] < flops["prefix_merging"] < flops["per_request"]
    assert "trie / prefix_merging: tokens/s" in out.stdout
    memory = [ln for ln in out.stdout.splitlines() if ln.startswith("prefix ")]
    assert memory == ["prefix    300: budget 512 -, budget 128 -, budget 32 -"]   # every budget ran (no GPU: no figure)


def test_a_failing_part_of_the_gpu_check_is_reported_and_the_rest_still_runs(capsys, monkeypatch):
    """One device session is short: an out-of-memory in one builder must not cost the others' figures."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    monkeypatch.setattr(gpu_check, "FAILED", [])
    ran = []
    for name in ("a", "b", "c"):
        with gpu_check.part(name):
            if name == "b":
                raise RuntimeError("CUDA out of memory")
            ran.append(name)
    assert ran == ["a", "c"] and gpu_check.FAILED == ["b"]
    out = capsys.readouterr().out
    assert "b FAILED" in out and "CUDA out of memory" in out


def test_the_memory_verdict_needs_every_budgets_figure(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    assert gpu_check.budget_line(15000, (16384, 4096, 1024), [9.5, 4.25, 4.25]) == \
        "prefix  15000: budget 16384 9.50, budget 4096 4.25, budget 1024 4.25; non-increasing as the budget shrinks: yes"
    assert gpu_check.budget_line(15000, (16384, 4096, 1024), [9.5, 4.25, 6.0]).endswith("shrinks: NO")
    # an out-of-memory at one budget is no verdict either way
    assert gpu_check.budget_line(60000, (16384, 4096, 1024), [None, 4.0, 3.0]) == \
        "prefix  60000: budget 16384 -, budget 4096 4.00, budget 1024 3.00"
