"""Local git repositories for task workspaces (a task's workspace {"git", "commit"})."""

from __future__ import annotations

import subprocess
from pathlib import Path


def commit(repo: Path, files: dict[str, str], message: str = "commit") -> str:
    """Writes `files` (path in the repository -> text) into repo, a git repository made on
    first use, commits them all, and returns the commit's hash."""
    if not (repo / ".git").exists():
        repo.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", message], check=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
