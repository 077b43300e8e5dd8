"""The DuckDB store: schema, writer, readers. All SQL of the project lives here."""

from .db import StoreBusy, connect, export_parquet, init_db, migrate, query, reading, set_reward
from .calllog import log_dir
from .records import CallRecord, SessionInfo
from .writer import CallWriter

__all__ = ["CallRecord", "CallWriter", "SessionInfo", "StoreBusy", "connect", "export_parquet", "init_db",
           "migrate", "log_dir", "query", "reading", "set_reward"]
