"""The API keys file's tenants (kimiserve/security.py ApiKeys): `KEY`, `KEY TENANT` and `KEY TENANT admin` lines, a
plain list meaning the one tenant `default`, and every other shape refused with an error naming the file and the line
and quoting none of its fields (a misplaced key must not reach a log)."""

from __future__ import annotations

import logging

import pytest

from kimiserve import security
from kimiserve.tenants import DEFAULT, Tenant


def keys_from(tmp_path, text: str) -> security.ApiKeys:
    path = tmp_path / "keys"
    path.write_text(text)
    return security.ApiKeys(path, recheck_s=0)


def test_a_plain_list_is_the_default_tenant(tmp_path):
    keys = keys_from(tmp_path, "# operators\nkey-one  # alice's\n\n key-two\n")
    assert keys.identify("key-one") == keys.identify("key-two") == Tenant("default", admin=False) == DEFAULT
    assert keys.identify("key-three") is None and keys.identify("key-on") is None and keys.identify("") is None


def test_keys_with_tenants_and_an_admin(tmp_path):
    keys = keys_from(tmp_path, "k-a1 acme\nk-a2\tacme   # rotation: two keys of one tenant\n"
                               "k-g globex.eu_2-x\nk-ops ops admin\nk-plain\n"
                               "k-a1 acme  # listed again, same identity\n")
    assert keys.identify("k-a1") == keys.identify("k-a2") == Tenant("acme")
    assert keys.identify("k-g") == Tenant("globex.eu_2-x")
    assert keys.identify("k-ops") == Tenant("ops", admin=True)
    assert keys.identify("k-plain") == DEFAULT
    assert keys.valid("k-ops") and not keys.valid("k-op")


def test_what_an_admin_and_a_tenant_may_do():
    alice, admin = Tenant("alice"), Tenant("ops", admin=True)
    assert alice.reads("alice") and alice.changes("alice")
    assert not alice.reads("bob") and not alice.changes("bob")
    assert admin.reads("alice") and not admin.changes("alice") and admin.changes("ops")


@pytest.mark.parametrize("line, fragment", [
    ("k-secret acme admin extra", "got 4 fields"),
    ("k-secret acme root", "got 3 fields whose third is not `admin`"),
    ("k-secret -acme", "the tenant name (5 characters) must be 1-64 letters"),
    ("k-secret " + "a" * 65, "the tenant name (65 characters)"),
    ("k-secret ac/me", "the tenant name (5 characters)"),
    ("k-secret admin", "`admin` is the admin mark, not a tenant name: write `KEY TENANT admin`"),
    ("k-one k-secret", "the key of line 1 again, with another tenant or admin mark"),  # two keys on one line
])
def test_a_malformed_line_is_refused_naming_file_and_line_and_quoting_no_field(tmp_path, caplog, line, fragment):
    path = tmp_path / "keys"
    path.write_text(f"k-one\n# comment\n{line}\n")
    with pytest.raises(security.SecurityConfigError) as refused:
        security.ApiKeys(path)
    message = str(refused.value)
    assert f"the API keys file {path}, line 3: " in message and fragment in message, message
    assert "k-secret" not in message

    path.write_text("k-one\n")  # a running router whose file turns bad: no key is valid (fails closed)
    keys = security.ApiKeys(path, recheck_s=0)
    with caplog.at_level(logging.ERROR):
        path.write_text(f"k-one\n# comment\n{line}\n")
        assert keys.identify("k-one") is None
    assert fragment in caplog.text and "k-secret" not in caplog.text
    path.write_text("k-one bob\n")
    assert keys.identify("k-one") == Tenant("bob")  # fixed: the new identity, at once
