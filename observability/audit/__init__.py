"""The tamper-evident audit trail: one hash-chained record per request, signed checkpoints, two stores."""

from observability.audit.backends import build_store
from observability.audit.log import AuditLog
from observability.audit.store import AuditStore

__all__ = ["AuditLog", "AuditStore", "build_store"]
