"""The DuckDB store: schema, writer, readers. All SQL of the project lives here."""

from .db import StoreBusy, connect, export_parquet, init_db, migrate, query, reading, set_reward
from .writer import CallWriter, spool_path

__all__ = ["CallWriter", "StoreBusy", "connect", "export_parquet", "init_db", "migrate",
           "query", "reading", "set_reward", "spool_path"]
