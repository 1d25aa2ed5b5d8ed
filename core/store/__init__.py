"""Persistence: SQLModel tables over SQLite (store.db) and the Store that reads and writes them."""

from core.store.db import Store
from core.store.migrations import SCHEMA_VERSION
from core.store.sqlite import StoreError

__all__ = ["SCHEMA_VERSION", "Store", "StoreError"]
