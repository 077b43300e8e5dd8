"""The dashboard (`polar-mitm dashboard`) in a real browser: headless Chromium (the Debian
package; nothing is downloaded) driven by Playwright's Python API.

The database comes from a real rollout: a rollout server, a gateway node and the proxy
(mitmdump) run an agent harness of ours against the scripted stand-in backend
(fake_vllm.FakeVLLM, "scripted"), which answers the first turn with a call of the harness's
`bash` tool and the next with text; the harness runs the command and sends its output back,
as an agent CLI does. The evaluator scores the samples differently, so a group's rewards
differ. The dashboard runs as its CLI starts it, on that database, while the server and the
node still run: the live test submits a new task and watches a page show it, and its
sessions' final state, without a reload.

Every page must load with no console error, no failed request and nothing fetched from
another host than the dashboard's (no CDN)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import quote, urlparse

import pytest

from support.fake_vllm import COMMAND, FakeVLLM
from support.agent_rollout import AgentRollout
from polar_mitm.stack import launch
from polar_mitm.store import query

POLAR = str(Path(sys.executable).parent / "polar-mitm")
WAIT_MS = 20_000      # the longest any page may take to show what it must

# The harness: support/agent_rollout.py's agent loop (one tool, `bash`) over the OpenAI chat
# API through the proxy. Rewards by sample, read by the evaluator (it runs in the finished workspace): they differ
# within a group; no proof file (the tool never ran) scores 0.
EVALUATOR = ('test -f polar_proof.txt || { echo "no proof"; echo 0; exit 0; }; '
             'case "$POLAR_SAMPLE" in 0) echo 1.0;; 1) echo 0.5;; 2) echo 0.25;; *) echo 0;; esac')
TASKS = {"fix": 4, "docs": 2}   # task id: samples
HELD = "(live)"                  # the live task's model calls wait for the test to let them go


class GatedVLLM(FakeVLLM):
    """The scripted stand-in; a call whose messages say HELD waits for `gate` (the live test
    sees its sessions running, then lets them finish)."""

    def __init__(self):
        super().__init__(mode="scripted")
        self.gate = threading.Event()

    def answer(self, body: dict) -> dict:
        if HELD in json.dumps(body.get("messages")):
            self.gate.wait(60)
        return super().answer(body)


class Stack(AgentRollout):
    """The rollout, and the dashboard on its database."""

    def __init__(self, root: Path):
        super().__init__(root, GatedVLLM().up(), EVALUATOR)
        (self.ws / "README.md").write_text("a workspace\n")
        self.dashboard: launch.Service | None = None
        self.url = ""

    def start_dashboard(self) -> None:
        port = launch.free_port()
        self.dashboard = launch.Service("dashboard", [POLAR, "dashboard", "--db", self.db, "--port", str(port)],
                                        log_path=self.root / "dashboard.log")
        self.url = f"http://127.0.0.1:{port}"
        launch.wait_http(self.url + "/", self.dashboard, timeout=30)

    def stop(self) -> None:
        self.backend.gate.set()
        super().stop(*([self.dashboard.stop] if self.dashboard else []))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, browser):
    """The rollout's stack, its first two tasks run; the browser first (no browser: fail
    before the rollout)."""
    s = Stack(tmp_path_factory.mktemp("dashboard"))
    try:
        s.run(TASKS)
        s.start_dashboard()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, the system's (the Debian package), for the whole module."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("the browser tests need Chromium: install the Debian package `chromium` "
                    "(scripts/install.sh does, as root)", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser tests need Playwright's Python package: .venv/bin/pip install playwright "
                    "(scripts/install.sh does; never `playwright install`: the system Chromium is used)",
                    pytrace=False)
    with sync_playwright() as p:
        # As root, Chromium refuses to start without --no-sandbox (its setuid/namespace
        # sandbox); the rest of its defaults work here.
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"] if os.geteuid() == 0 else [])
        yield b
        b.close()


class Watched:
    """A page and everything that went wrong on it: console errors, uncaught exceptions,
    failed requests, HTTP errors, and any request to another host than 127.0.0.1."""

    def __init__(self, browser, base: str):
        self.context = browser.new_context(viewport={"width": 1400, "height": 900})
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.base = base
        self.problems: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(f"console error: {m.text}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"uncaught: {e}"))
        self.page.on("requestfailed", lambda r: self.problems.append(f"request failed: {r.url} ({r.failure})"))
        self.page.on("response", lambda r: r.status >= 400 and self.problems.append(f"HTTP {r.status}: {r.url}"))
        self.page.on("request", self._request)

    def _request(self, r) -> None:
        u = urlparse(r.url)
        if u.scheme not in ("data", "blob", "about") and u.hostname != "127.0.0.1":
            self.problems.append(f"request to another host: {r.url}")

    def open(self, path: str):
        self.page.goto(self.base + path)
        self.page.wait_for_selector("body[data-generation]", state="attached")
        return self.page

    def generation(self) -> int:
        return int(self.page.get_attribute("body", "data-generation") or 0)

    def check(self) -> None:
        """Nothing went wrong so far (called before the page closes: leaving a page ends its
        event stream, which the browser reports as a failed request)."""
        assert not self.problems, "\n".join(self.problems)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(stack, browser):
    opened: list[Watched] = []

    def open_(path: str) -> Watched:
        w = Watched(browser, stack.url)
        opened.append(w)
        w.open(path)
        return w

    yield open_
    for w in opened:
        w.close()


def _sessions(db: str, task_id: str) -> list[tuple[str, str, float | None]]:
    _, rows = query(db, "SELECT session_id, state, reward FROM rollout_sessions WHERE task_id = ? ORDER BY 1",
                    [task_id])
    return rows


def _tool_calls(db: str, session_id: str) -> list[tuple[str, str]]:
    """(name, arguments) of each tool call the session's model answered with, as recorded."""
    _, rows = query(db, "SELECT response_json FROM calls WHERE session_id = ? ORDER BY seq", [session_id])
    out = []
    for (resp,) in rows:
        body = json.loads(resp) if isinstance(resp, str) else resp
        for choice in (body or {}).get("choices") or []:
            for tc in (choice.get("message") or {}).get("tool_calls") or []:
                out.append((tc["function"]["name"], tc["function"]["arguments"]))
    return out


# -- the pages --------------------------------------------------------------------------------
def test_every_page_loads_with_no_error_and_nothing_from_another_host(stack, watched):
    (a, _, _), (b, _, _) = _sessions(stack.db, "fix")[:2]
    pages = {"runs": ("/", "table#iterations"), "groups": ("/groups", 'table#groups tr[data-task="fix"]'),
             "group": ("/groups/fix", "table#samples tr[data-session]"),
             "session": (f"/sessions/{quote(a)}", "ol#turns li.turn"),
             "compare": (f"/compare?a={quote(a)}&b={quote(b)}", ".compare-col"),
             "compare-versions": ("/compare?task=fix", ".compare-col")}
    opened = []
    for name, (path, shows) in pages.items():
        w = watched(path)
        assert w.page.get_attribute("body", "data-page") == name.split("-")[0], path
        w.page.wait_for_selector(shows)
        assert not w.page.locator("#load-error, .error-box").count(), w.page.inner_text("main")
        opened.append(w)
    # the event stream opened (1.2 s after the first drawing) and still nothing went wrong
    for w in opened:
        w.page.wait_for_function("() => document.getElementById('status').classList.contains('live')")
        w.check()
    assert opened[0].page.locator("svg#reward-chart").count() == 1


def test_the_groups_list_and_a_group_show_every_sample_with_its_reward(stack, watched):
    w = watched("/groups")
    for task_id in TASKS:
        w.page.wait_for_selector(f'table#groups tr[data-task="{task_id}"]')
    w.page.click('table#groups tr[data-task="fix"] a[href="/groups/fix"]')
    w.page.wait_for_url("**/groups/fix")
    w.page.wait_for_selector('body[data-page="group"] table#samples tr[data-session]')
    rows = _sessions(stack.db, "fix")
    assert len(rows) == TASKS["fix"] and sorted(r for _, _, r in rows) == [0.0, 0.25, 0.5, 1.0], rows
    shown = w.page.eval_on_selector_all(
        "table#samples tr[data-session]",
        "rows => rows.map(r => [r.dataset.session, r.querySelector('td.reward').innerText, r.innerText])")
    assert sorted(sid for sid, _, _ in shown) == [sid for sid, _, _ in rows]
    by_sid = {sid: (reward, text) for sid, reward, text in shown}
    for sid, state, reward in rows:
        assert state == "done" and float(by_sid[sid][0]) == reward, (sid, reward, by_sid[sid])
        assert "done" in by_sid[sid][1]
    # each sample's evaluator output and harness output are there
    assert w.page.locator("table#samples .eval-output").count() == TASKS["fix"]
    assert w.page.locator("table#samples .harness-output").count() == TASKS["fix"]
    # a one-line output (the evaluator's score) is shown in the row, not folded
    out = w.page.locator("table#samples .eval-output").first
    assert out.locator("summary").count() == 0
    assert out.locator("pre").inner_text().strip() in ("1.0", "0.5", "0.25", "0")
    w.check()


def test_the_session_page_shows_the_recorded_tool_calls_and_tokens_with_logprobs(stack, watched):
    sid = _sessions(stack.db, "fix")[0][0]
    recorded = _tool_calls(stack.db, sid)
    assert [(name, json.loads(args)) for name, args in recorded] == [("bash", {"command": COMMAND})], recorded
    w = watched(f"/sessions/{quote(sid)}")
    page = w.page
    page.wait_for_selector("ol#turns li.turn")
    roles = page.eval_on_selector_all("ol#turns li.turn", "ts => ts.map(t => t.dataset.role)")
    assert roles == ["system", "user", "assistant", "tool", "assistant"], roles
    for name, arguments in recorded:
        call = page.locator(f'li.turn[data-role="assistant"] .tool-call[data-tool="{name}"]')
        assert call.count() == 1, f"no .tool-call for {name}"
        assert json.loads(call.locator("pre.arguments").inner_text()) == json.loads(arguments)
        assert COMMAND in call.inner_text()
    # the tool's result went back to the model, and the model's last answer is there
    assert "polar-tool-ok" in page.locator('li.turn[data-role="tool"]').inner_text()
    assert "polar-tool-ok" in page.locator('li.turn[data-role="assistant"]').last.inner_text()
    # every recorded call is listed, with its sampled tokens, each with its logprob as recorded
    _, calls = query(stack.db, "SELECT seq, len(token_ids), logprobs FROM calls WHERE session_id = ? ORDER BY seq",
                     [sid])
    assert len(calls) == 2
    shown = page.eval_on_selector_all("table#calls tr[data-call]", "rs => rs.map(r => Number(r.dataset.call))")
    assert shown == [seq for seq, _, _ in calls], shown
    for seq, n, logprobs in calls:
        toks = page.eval_on_selector_all(f'table#calls tr[data-call="{seq}"] span.tok[data-logprob]',
                                         "ts => ts.map(t => Number(t.dataset.logprob))")
        assert len(toks) == n and all(abs(x - y) < 1e-4 for x, y in zip(toks, logprobs)), (seq, toks[:5], n)
    assert "Done: the command printed polar-tool-ok." in page.locator("pre#harness-output").inner_text()
    assert page.locator("pre#eval-output").inner_text().strip() == "1.0"
    w.check()


def test_compare_shows_two_sessions_side_by_side(stack, watched):
    (a, _, _), (b, _, _) = _sessions(stack.db, "fix")[:2]
    w = watched(f"/compare?a={quote(a)}&b={quote(b)}")
    cols = w.page.locator(".compare-col")
    cols.nth(1).wait_for()
    assert cols.count() == 2
    assert [cols.nth(i).get_attribute("data-session") for i in range(2)] == [a, b]
    for i, sid in enumerate((a, b)):
        assert sid in cols.nth(i).locator(".session-id").inner_text()
        assert cols.nth(i).locator('.tool-call[data-tool="bash"]').count() == 1
        assert cols.nth(i).locator("span.tok[data-logprob]").count() >= 1
    w.check()


# -- live ---------------------------------------------------------------------------------------
def test_live_pages_show_a_new_task_running_then_done_without_a_reload(stack, watched):
    """The Runs page and the groups list, open while a new task runs: its sessions show up
    running (their model calls held), then done with their rewards, and neither page reloads."""
    runs, groups = watched("/"), watched("/groups")
    groups.page.wait_for_selector('table#groups tr[data-task="fix"]')
    runs.page.wait_for_selector('#live [data-state="done"]')
    for w in (runs, groups):
        w.page.wait_for_function("() => document.getElementById('status').classList.contains('live')")
        w.page.evaluate("window.__notReloaded = true")
    before = [runs.generation(), groups.generation()]
    done_before = int(runs.page.get_attribute('#live [data-state="done"]', "data-count"))
    assert done_before == sum(TASKS.values())

    assert HELD in stack.task("live", 2)["instruction"]
    stack.server.submit(stack.task("live", 2))
    # running: both samples in the harness, their model calls held by the backend
    groups.page.wait_for_selector('table#groups tr[data-task="live"] [data-state="run"][data-count="2"]',
                                  timeout=60_000)
    runs.page.wait_for_selector('#live [data-state="run"][data-count="2"]')
    runs.page.wait_for_selector('#live [data-task-state="running"][data-count="1"]')
    stack.backend.gate.set()
    assert stack.server.wait(["live"], timeout=60), stack.server.group("live")
    # done: the task's state and every sample, and its mean reward (1.0 + 0.5) / 2
    groups.page.wait_for_function(
        """() => { const r = document.querySelector('table#groups tr[data-task="live"]');
                   if (!r || !r.querySelector('.st-done:not([data-state])')) return false;
                   const chips = [...r.querySelectorAll('[data-state]')];
                   return chips.length === 1 && chips[0].dataset.state === 'done' && chips[0].dataset.count === '2'; }""",
        timeout=30_000)
    assert "0.75" in groups.page.locator('table#groups tr[data-task="live"]').inner_text()
    runs.page.wait_for_selector(f'#live [data-state="done"][data-count="{done_before + 2}"]')
    assert runs.page.locator('#live [data-state="run"]').count() == 0
    for w, gen in zip((runs, groups), before):
        assert w.page.evaluate("window.__notReloaded === true"), "the page was reloaded"
        assert w.generation() > gen
        w.check()
