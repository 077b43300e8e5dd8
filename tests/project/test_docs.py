"""The docs cannot go stale silently: docs/options.md is what scripts/options_doc.py generates
from the addon now, every relative link in README.md and docs/*.md reaches an existing file
(and, for a #fragment into a markdown file, an existing heading), and the README's first
screen keeps the two commands of a fresh machine."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def _options_doc():
    spec = importlib.util.spec_from_file_location("options_doc", ROOT / "scripts" / "options_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """The text less fenced code blocks and code spans (no links live there)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCE.sub("", path.read_text())):
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_options_doc_is_current():
    module = _options_doc()
    expected = module.generate()
    current = module.OUT.read_text() if module.OUT.exists() else ""
    assert current == expected, (
        "docs/options.md is not what the addon's options generate now: "
        "rerun `.venv/bin/python scripts/options_doc.py` and commit docs/options.md")


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for m in _LINK.finditer(_prose(doc.read_text())):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            where = f"{doc.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where} -> no such file {dest}")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{where} -> no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_sees_links():
    """The checker itself: it finds links outside code, and none inside it."""
    text = "see [a](docs/x.md#y) and `[b](nope.md)`\n```\n[c](nope.md)\n```\n"
    assert [m.group(1) for m in _LINK.finditer(_prose(text))] == ["docs/x.md#y"]
    assert _slug("Training: `polar-train`") == "training-polar-train"
    assert _slug("Rollouts: tasks in, scored sessions out") == "rollouts-tasks-in-scored-sessions-out"


def test_readme_first_screen_has_the_quick_start():
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    for command in ("bash scripts/install.sh && .venv/bin/polar-mitm demo", "bash scripts/test.sh",
                    "polar-train loop"):
        assert command in first_screen, f"the README's first 60 lines lost `{command}`"
