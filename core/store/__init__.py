"""Persistence: SQLModel tables over SQLite (store.db) and the Store that reads and writes them."""

from specpilot.core.store.db import Store
from specpilot.core.store.migrations import SCHEMA_VERSION
from specpilot.core.store.sqlite import StoreError

__all__ = ["SCHEMA_VERSION", "Store", "StoreError"]
