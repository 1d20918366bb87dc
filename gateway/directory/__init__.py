"""The tenant and key directory: admin-managed tenants and API keys, in a store of their own.

PostgreSQL (:mod:`.postgres`) is shared by every replica; SQLite (:mod:`.sqlite`) belongs
to one process. :class:`~gateway.directory.live.LiveDirectory` keeps this process's
snapshot fresh and fails closed when the store cannot be read.
"""

from gateway.directory.backends import build_store
from gateway.directory.store import DirectoryStore

__all__ = ["DirectoryStore", "build_store"]
