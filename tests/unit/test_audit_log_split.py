"""The audit writer's request path (observability.audit.log) and what it leaves to its bases (#27)."""

from __future__ import annotations

import ast
from pathlib import Path

import observability.audit.log as audit_log
from observability.audit import AuditLog
from observability.audit.outage import AuditOutage
from observability.audit.upkeep import AuditUpkeep
from observability.audit.writer_state import WriterState

_AUDIT = Path(audit_log.__file__).parent


def test_names_stay_importable_from_the_log_module() -> None:
    assert audit_log.AuditLog is AuditLog
    assert audit_log.AuditUpkeep is AuditUpkeep
    assert callable(audit_log.now_iso) and audit_log.Pending.__name__ == "Pending"


def test_the_log_takes_start_close_outage_and_retention_from_its_bases() -> None:
    assert AuditLog.__mro__[1:4] == (AuditUpkeep, AuditOutage, WriterState)
    for name in ("start", "aclose", "append_event", "retain", "rows_for", "_replay", "_to_spool"):
        assert name not in vars(AuditLog), name
        assert callable(getattr(AuditLog, name))
    for name in ("admit", "submit", "wait", "_run", "_write", "_encode", "_gap_record", "depth", "broken"):
        assert name in vars(AuditLog), name


def test_the_bases_never_import_the_log_module() -> None:
    for module in ("outage.py", "upkeep.py", "writer_state.py"):
        tree = ast.parse((_AUDIT / module).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "observability.audit.log" not in imported, module
