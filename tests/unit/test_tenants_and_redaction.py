"""Key minting and resolution, tenant config validation, and the PII redaction rule set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings
from gateway.tenants import Directory, KeyRefused, key_digest, key_id_of, mint_key
from observability.audit.redact import redact


def _settings(**kw) -> Settings:
    return Settings(**kw)


def test_minted_keys_are_random_and_only_their_digest_is_kept():
    a, b = mint_key(), mint_key()
    assert a.key != b.key and a.id != b.id
    assert a.key.startswith(f"og_{a.id}_") and len(a.key) >= 55
    assert key_id_of(a.key) == a.id and a.sha256 == key_digest(a.key)
    assert key_id_of("og_short") is None and key_id_of("sk-" + "x" * 40) is None
    assert key_id_of("og_ABCDEFGHIJKL_" + "x" * 43) is None  # ids are lowercase


def test_directory_resolves_keys_and_refuses_alike():
    k, off, dormant = mint_key(), mint_key(), mint_key()
    settings = _settings(
        tenants=[{"name": "acme", "priority": "batch"}, {"name": "sleepy", "enabled": False}],
        api_keys=[
            {"id": k.id, "tenant": "acme", "sha256": k.sha256},
            {"id": off.id, "tenant": "acme", "sha256": off.sha256, "enabled": False},
            {"id": dormant.id, "tenant": "sleepy", "sha256": dormant.sha256},
        ],
    )
    d = Directory.build(settings, read_at=0.0)
    assert settings.auth_required
    p = d.authenticate(f"Bearer {k.key}")
    assert (p.tenant.name, p.tenant.priority, p.key_id) == ("acme", "batch", k.id)
    assert d.authenticate(f"bearer   {k.key}").key_id == k.id
    cases = {
        None: "missing",
        "": "missing",
        "Basic abc": "missing",
        "Bearer ": "missing",
        "Bearer nope": "invalid",
        f"Bearer {k.key}x": "invalid",
        f"Bearer {mint_key().key}": "invalid",
        f"Bearer {off.key}": "disabled",
        f"Bearer {dormant.key}": "disabled",
    }
    messages = set()
    for header, reason in cases.items():
        with pytest.raises(KeyRefused) as info:
            d.authenticate(header)
        assert info.value.reason == reason, header
        messages.add(info.value.message)
    assert len(messages) == 1


def test_no_config_means_authentication_is_off_and_any_key_material_means_on():
    # The embedded default (nothing configured) is open; naming a tenant, a key or an admin key is not.
    assert not _settings().auth_required
    assert _settings(tenants=[{"name": "a"}]).auth_required
    assert _settings(admin={"api_key": "x" * 32}).auth_required


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "tenants[1].name"),
        ({"tenants": [{"name": "a", "policy_set": "nope"}]}, "tenants[0].policy_set"),
        (
            {"tenants": [{"name": "a"}], "api_keys": [{"id": "abcdefgh", "tenant": "b", "sha256": "0" * 64}]},
            "api_keys[0].tenant",
        ),
        ({"tenants": [{"name": "a", "requests_per_minute": 0}]}, "requests_per_minute"),
        ({"api_keys": [{"id": "abcdefgh", "tenant": "a", "sha256": "plain-text-key"}]}, "sha256"),
        ({"audit": {"store": "postgres"}}, "postgres_dsn"),
        ({"audit": {"group_commit_ms": 50}}, "group_commit_ms"),
    ],
)
def test_bad_tenancy_config_names_the_field(kw, field):
    with pytest.raises(ValidationError) as info:
        _settings(**kw)
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mail jane.doe+x@example.co.uk now", "mail [EMAIL] now"),
        ("card 4111-1111-1111-1111 ok", "card [CARD] ok"),
        ("not a card 1234 5678 9012 3456", "not a card 1234 5678 9012 3456"),
        ("ssn 078-05-1120", "ssn [SSN]"),
        ("call +44 20 7946 0958 or (415) 555-0132", "call [PHONE] or [PHONE]"),
        ("iban GB82 WEST 1234 5698 7654 32", "iban [IBAN]"),
        ("from 192.168.10.254 and 2001:db8::8a2e:370:7334", "from [IP] and [IP]"),
        ("key sk-proj-abcdefghijklmnop1234 and Bearer abc.def.ghi123", "key [SECRET] and [SECRET]"),
        (
            "at 12:30:45 on 2024-05-01, 42 items, version 1.2.3",
            "at 12:30:45 on 2024-05-01, 42 items, version 1.2.3",
        ),
    ],
)
def test_redaction_rules(text, expected):
    assert redact(text) == expected
