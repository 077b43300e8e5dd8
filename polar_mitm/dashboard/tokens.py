"""Token text for the session page's sampled tokens: a tokenizer.json read with the
`tokenizers` library (fast, no torch), loaded on first use and kept; each token id's text
cached. Without one the page shows token ids."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("polar.dashboard")

TOKENIZER_FILE = "tokenizer.json"


def find_tokenizer(run_dir: str | Path | None) -> Path | None:
    """The latest checkpoint under RUN/checkpoints (vN, highest N) that holds a tokenizer.json."""
    if run_dir is None:
        return None
    folder = Path(run_dir) / "checkpoints"
    try:
        found = [(int(m.group(1)), p) for p in folder.iterdir()
                 if (m := re.fullmatch(r"v(\d+)", p.name)) and (p / TOKENIZER_FILE).is_file()]
    except OSError:
        return None
    return max(found)[1] if found else None


class TokenText:
    """id -> text of one token (None without a tokenizer, or for an id it does not know)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._tok: Any = None
        self._failed: str | None = None
        self._cache: dict[int, str | None] = {}
        self._lock = threading.Lock()

    @property
    def source(self) -> str | None:
        return None if self.path is None else str(self.path)

    @property
    def error(self) -> str | None:
        return self._failed

    def _load(self) -> Any:
        if self._tok is not None or self._failed is not None or self.path is None:
            return self._tok
        file = self.path / TOKENIZER_FILE if self.path.is_dir() else self.path
        try:
            from tokenizers import Tokenizer
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:   # a missing library or a file it cannot read: ids only
            self._failed = f"{file}: {e}"
            log.warning("dashboard: no token text (%s)", self._failed)
        return self._tok

    def preload(self) -> None:
        """Load the tokenizer now (the app does, in a thread, at start: the first session page
        then does not wait for it)."""
        with self._lock:
            self._load()

    def texts(self, ids: list[int]) -> list[str | None]:
        with self._lock:
            tok = self._load()
            if tok is None:
                return [None] * len(ids)
            out = []
            for i in ids:
                if i not in self._cache:
                    self._cache[i] = self._one(tok, i)
                out.append(self._cache[i])
            return out

    @staticmethod
    def _one(tok: Any, i: int) -> str | None:
        try:
            text = tok.decode([i], skip_special_tokens=False)
        except Exception:
            text = None
        if not text or "\ufffd" in text:   # a byte of a character, or a special token decoded to nothing
            piece = tok.id_to_token(i)
            return piece if piece is not None else text
        return text
