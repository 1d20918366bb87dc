"""Start-up decisions of the front door: weak and placeholder secrets never boot, and the banner and
``check-config`` say whether a key is required and why."""

from __future__ import annotations

import base64
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import auth_banner
from gateway.secret_check import WeakSecret, check, problems
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "ops" / "config" / "omnigate.yaml"


def _cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def _env_example_value(name: str) -> str:
    for line in (ROOT / "ops" / "env.example").read_text().splitlines():
        if line.startswith(name + "="):
            return line.split("=", 1)[1]
    raise KeyError(name)


@pytest.mark.parametrize(
    "key",
    [
        "replace-with-the-output-of-openssl-rand-hex-32",  # the example files' value
        "changeme-changeme-changeme-changeme",
        "adm-secret-0123456789",  # what people type
        "k" * 40,
        "abababababababababababababababababab",
    ],
)
def test_placeholder_and_typed_admin_keys_are_refused(key):
    with pytest.raises(WeakSecret, match=re.escape("admin.api_key")):
        check(Settings(admin={"api_key": key}))


def test_typed_signing_keys_are_refused_and_generated_ones_boot():
    with pytest.raises(WeakSecret, match=re.escape("audit.signing.key")):
        check(Settings(audit={"signing": {"key": "checkpoint-secret-for-tests"}}))
    weak_seed = base64.b64encode(b"\x01" * 32).decode()
    with pytest.raises(WeakSecret, match="Ed25519 seed"):
        check(Settings(audit={"signing": {"algorithm": "ed25519", "key": weak_seed}}))
    good = Settings(
        admin={"api_key": secrets.token_hex(32)}, audit={"signing": {"key": secrets.token_urlsafe(32)}}
    )
    assert problems(good) == []
    ed = Settings(
        audit={"signing": {"algorithm": "ed25519", "key": base64.b64encode(secrets.token_bytes(32)).decode()}}
    )
    assert problems(ed) == []


def test_a_refusal_names_every_field_and_never_repeats_the_secret():
    typed = "my-admin-password-is-long-enough-1"
    found = problems(Settings(admin={"api_key": typed}, audit={"signing": {"key": "short"}}))
    assert [p.split(":")[0] for p in found] == ["admin.api_key", "audit.signing.key"]
    assert typed not in str(found) and "openssl rand" in str(found)


def test_the_example_config_and_env_file_do_not_boot(tmp_path):
    out = _cli("check-config", str(EXAMPLE))
    assert out.returncode == 1
    for field in ("admin.api_key", "audit.signing.key", "engines[2].api_key"):
        assert field in out.stderr
    # The compose file hands the env example's admin key to the gateway.
    env = {**__import__("os").environ, "OMNIGATE_ADMIN__API_KEY": _env_example_value("OMNIGATE_ADMIN_KEY")}
    cfg = tmp_path / "min.yaml"
    cfg.write_text("logging: {level: warning}\n")
    served = _cli("serve", "--config", str(cfg), "--port", "0", env=env)
    assert (
        served.returncode == 1 and "refusing to start" in served.stderr and "admin.api_key" in served.stderr
    )


def test_the_banner_says_whether_a_key_is_required_and_why():
    [open_line] = auth_banner(Settings())
    assert open_line.startswith("authentication: OFF (no config names tenants")
    lines = auth_banner(Settings(admin={"api_key": secrets.token_hex(32)}))
    assert lines[0].startswith("authentication: required")
    assert "every request gets 401" in lines[1]
    several = auth_banner(Settings(tenants=[{"name": "a"}], auth={"replicas": 2}))
    assert any("admin writes to tenants and keys: refused" in line for line in several)
    explicit = auth_banner(Settings(auth={"required": False}, admin={"api_key": secrets.token_hex(32)}))
    assert explicit == [
        "authentication: OFF (auth.required: false): every request is served, unauthenticated"
    ]


def test_check_config_reports_the_auth_decision(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"admin: {{api_key: {secrets.token_hex(32)}}}\n")
    out = _cli("check-config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "authentication: required" in out.stdout and "every request gets 401" in out.stdout


def test_tenants_an_older_version_kept_in_the_audit_database_are_imported_once(tmp_path):
    import sqlite3

    from gateway.tenants import mint_key

    audit_db = tmp_path / "audit.db"
    k = mint_key()
    db = sqlite3.connect(audit_db)
    db.executescript(
        "CREATE TABLE tenants (name TEXT PRIMARY KEY, config TEXT NOT NULL, updated_at TEXT NOT NULL);"
        "CREATE TABLE api_keys (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, sha256 TEXT NOT NULL,"
        " enabled INTEGER NOT NULL, created_at TEXT NOT NULL);"
    )
    db.execute("INSERT INTO tenants VALUES ('old', '{\"name\": \"old\"}', '2026-01-01T00:00:00Z')")
    db.execute("INSERT INTO api_keys VALUES (?, 'old', ?, 1, '2026-01-01T00:00:00Z')", (k.id, k.sha256))
    db.commit()
    db.close()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"audit: {{sqlite_path: {audit_db}}}\n")
    first = _cli("directory", "import", "--config", str(cfg))
    assert first.returncode == 0, first.stderr
    assert "imported 1 tenants and 1 keys" in first.stdout
    again = _cli("directory", "import", "--config", str(cfg))
    assert "imported 0 tenants and 0 keys" in again.stdout and "2 already there" in again.stdout
    from gateway.directory.sqlite import SQLiteDirectory

    async def keys() -> list:
        store = SQLiteDirectory(tmp_path / "omnigate-directory.db")
        await store.open()
        try:
            return (await store.load())[2]
        finally:
            await store.close()

    import asyncio

    [entry] = asyncio.run(keys())
    assert (entry.id, entry.tenant, entry.sha256, entry.enabled) == (k.id, "old", k.sha256, True)
