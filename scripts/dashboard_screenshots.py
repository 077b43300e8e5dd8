"""Screenshots of every dashboard page (docs/dashboard.md), of a real run's database.

    .venv/bin/python scripts/dashboard_screenshots.py --db RUN/rollouts.duckdb --run RUN --out docs/img

The database is copied first (with its call log) and the copy migrated: the run's own files
are never written. `polar-mitm dashboard` serves the copy; headless Chromium (the Debian
package, through Playwright; nothing is downloaded) visits each page at 1400x900 and writes a
full-page PNG of it:

    dashboard-runs.png              the Runs page: the loop's iterations, the reward chart
    dashboard-groups.png            the list of groups (tasks)
    dashboard-group.png             the group whose rewards differ most
    dashboard-session.png           the session with the most tool calls (else calls, tokens)
    dashboard-compare.png           that group's best and worst sessions side by side
    dashboard-compare-versions.png  one task sampled at two policy versions (a loop's run)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.stack import launch  # noqa: E402
from polar_mitm.store import query  # noqa: E402
from polar_mitm.store.db import init_db  # noqa: E402

POLAR = str(Path(sys.executable).parent / "polar-mitm")
VIEWPORT = {"width": 1400, "height": 900}


def copy_db(src: Path, into: Path) -> Path:
    """The database and what travels with it (its call log: calls not loaded yet), migrated."""
    dst = into / src.name
    shutil.copy2(src, dst)
    for extra in (src.with_name(src.name + ".wal"), src.with_name(src.name + ".log")):
        if extra.is_dir():
            shutil.copytree(extra, into / extra.name)
        elif extra.exists():
            shutil.copy2(extra, into / extra.name)
    init_db(dst)
    return dst


def count_tool_calls(obj) -> int:
    """Tool calls in a recorded response, whatever its API style: OpenAI chat's tool_calls,
    Anthropic's tool_use blocks, Responses' function_call items, Gemini's functionCall parts."""
    if isinstance(obj, list):
        return sum(count_tool_calls(x) for x in obj)
    if not isinstance(obj, dict):
        return 0
    n = 0
    if obj.get("type") in ("tool_use", "function_call", "custom_tool_call", "local_shell_call"):
        n += 1
    if "functionCall" in obj:
        n += 1
    if isinstance(obj.get("tool_calls"), list):
        n += len(obj["tool_calls"])
    return n + sum(count_tool_calls(v) for k, v in obj.items() if k != "tool_calls")


def pick(db: Path) -> dict[str, str]:
    """Which group, session and pairs to show."""
    _, rows = query(db, "SELECT task_id, session_id, reward FROM rollout_sessions "
                        "WHERE state = 'done' AND reward IS NOT NULL ORDER BY task_id, session_id")
    if not rows:
        _, rows = query(db, "SELECT task_id, session_id, reward FROM sessions "
                            "WHERE task_id IS NOT NULL AND reward IS NOT NULL ORDER BY task_id, session_id")
    groups: dict[str, list[tuple[str, float]]] = {}
    for task, sid, reward in rows:
        groups.setdefault(task, []).append((sid, reward))
    if not groups:
        raise SystemExit(f"{db}: no rewarded sessions to show")
    # the group whose rewards differ most (then the largest; a training group before a held-out one)
    task = max(groups, key=lambda t: (statistics.pstdev([r for _, r in groups[t]]), len(groups[t]),
                                      ".eval" not in t, t))
    best = max(groups[task], key=lambda x: x[1])[0]
    worst = min(groups[task], key=lambda x: x[1])[0]
    # the session with the most tool calls, then the most calls, then the most generated tokens
    _, calls = query(db, "SELECT session_id, response_json, len(token_ids) FROM calls")
    score: dict[str, list[int]] = {}
    for sid, resp, ntok in calls:
        body = json.loads(resp) if isinstance(resp, str) else resp
        s = score.setdefault(sid, [0, 0, 0])
        s[0] += count_tool_calls(body)
        s[1] += 1
        s[2] += ntok or 0
    session = max(score, key=lambda sid: (*score[sid], sid)) if score else best
    out = {"task": task, "best": best, "worst": worst, "session": session,
           "session_tool_calls": str(score.get(session, [0])[0])}
    # one task at two policy versions: a loop's task ids are TASK@RUN.ITERATION
    _, versions = query(db, "SELECT r.task_id, min(c.policy_version), max(c.policy_version) FROM calls c "
                            "JOIN rollout_sessions r USING (session_id) GROUP BY 1")
    base = task.split("@")[0]
    same = sorted({t for t, _, _ in versions if t.split("@")[0] == base})
    out["versions_task"] = base if len(same) > 1 else ""
    return out


def versions_url(base: str, task: str) -> str | None:
    """/compare?task=TASK at two policy versions: the first, and the best one after it by mean
    reward (else the last), each shown by its best-rewarded session."""
    import httpx

    vs = [v for v in httpx.get(f"{base}/api/compare", params={"task": task}, timeout=30, trust_env=False)
          .json().get("versions", []) if v["sessions"]]
    if len(vs) < 2:
        return None
    va = vs[0]
    vb = max(vs[1:], key=lambda v: (v["reward"]["mean"] if v["reward"]["mean"] is not None else -1e9,
                                    vs.index(v)))

    def best(v: dict) -> str:
        return max(v["sessions"], key=lambda x: (x["reward"] if x["reward"] is not None else -1e9,
                                                 x["current"]))["session_id"]

    q = {"task": task, "va": va["policy_version"], "vb": vb["policy_version"], "a": best(va), "b": best(vb)}
    return "/compare?" + "&".join(f"{k}={quote(str(v), safe='')}" for k, v in q.items() if v is not None)


# What each page opens before its picture (details elements, closed by default).
OPEN = {"group": "table#samples tr[data-session]:first-child details.out", "session": 'details[data-key="tools"]'}


def shoot(page, url: str, path: Path, open_: str | None = None) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-generation]", state="attached")
    # drawn, and the live event stream open (the header says so)
    page.wait_for_function("() => document.getElementById('status').classList.contains('live')")
    if open_:
        page.evaluate("sel => document.querySelectorAll(sel).forEach(d => { d.open = true; })", open_)
    page.screenshot(path=str(path), full_page=True)
    print(f"{path}: {url}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, type=Path, help="a run's database (copied; never written)")
    ap.add_argument("--run", type=Path, help="the loop's run folder (polar-train loop --out / polar-mitm demo)")
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dashboard-shots-") as tmp:
        db = copy_db(args.db, Path(tmp))
        chosen = pick(db)
        print("showing:", json.dumps(chosen))
        port = launch.free_port()
        argv_ = [POLAR, "dashboard", "--db", str(db), "--port", str(port)]
        if args.run:
            argv_ += ["--run", str(args.run)]
        service = launch.Service("dashboard", argv_, log_path=Path(tmp) / "dashboard.log")
        base = f"http://127.0.0.1:{port}"
        ok = False
        try:
            launch.wait_http(base + "/", service, timeout=60)
            pages = {"runs": "/", "groups": "/groups", "group": f"/groups/{quote(chosen['task'], safe='')}",
                     "session": f"/sessions/{quote(chosen['session'], safe='')}",
                     "compare": f"/compare?a={quote(chosen['best'], safe='')}&b={quote(chosen['worst'], safe='')}"}
            if chosen["versions_task"] and (url := versions_url(base, chosen["versions_task"])):
                pages["compare-versions"] = url
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium,
                                            args=["--no-sandbox"] if os.geteuid() == 0 else [])
                page = browser.new_page(viewport=VIEWPORT)
                errors: list[str] = []
                page.on("console", lambda m: m.type == "error" and errors.append(m.text))
                page.on("pageerror", lambda e: errors.append(str(e)))
                for name, path in pages.items():
                    shoot(page, base + path, args.out / f"dashboard-{name}.png", OPEN.get(name))
                browser.close()
            for e in errors:
                print(f"console error: {e}", file=sys.stderr)
            ok = not errors
        finally:
            service.stop()
            if not ok:
                print(f"the dashboard's log:\n{service.tail()}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
