"""The meta table: one text value per key (the schema version, the key salt, the call log's
position, the database's id, how far the rollout journal is folded in)."""

from __future__ import annotations


def meta_value(con, key: str) -> str | None:
    row = con.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
    return row[0] if row else None


def set_meta_value(con, key: str, value: str) -> None:
    """Store the value, replacing any (inside the caller's transaction, if one is open)."""
    con.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                [key, value])
