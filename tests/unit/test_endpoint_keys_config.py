"""The endpoint's keys (apiKey, apiKeys) and certificate (tls): every bad input refused before anything starts,
each with its key path, and no message showing a key or a certificate's text. The spellings are ours: each row
is one way a user gets it wrong."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from components.config import ConfigError, load_cluster_config
from tests.tls_ca import DAY, NOW, TestCa
from tests.unit.test_config import config

GOOD = "sk-good-key-0000000000000001"
CA = TestCa()
OTHER_CA = TestCa("another CA")
HEAD = "10.0.0.1"  # the base config's head: the endpoint's host


def problems(raw) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw)
    return caught.value.problems


def tls(issued=None, ca=None, **issue) -> dict:
    issued = issued or CA.issue(HEAD, **issue)
    return {"certificate": issued.certificate, "key": issued.key, "ca": (ca or CA).pem}


def secrets_in(raw: dict) -> list[str]:
    """Every secret text of `raw`, and each line of a PEM on its own (a message showing part of one shows one)."""
    keys = raw.get("apiKeys")
    found = [raw.get("apiKey"), *(keys.values() if isinstance(keys, dict) else keys or [])]
    for value in (raw.get("tls") or {}).values():
        found += [line for line in str(value).splitlines() if len(line) > 20 and not line.startswith("-----")]
    return [each for each in found if isinstance(each, str) and each.strip()]


def refused(raw: dict, path: str, expected: str) -> str:
    found = problems(raw)
    lines = [line for line in found if line.startswith(f"{path}:")]
    assert lines and any(expected in line for line in lines), found
    for line in found:
        for secret in secrets_in(raw):
            assert secret not in line, (secret, line)
    return lines[0]


# --- keys ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "path", "expected"),
    [
        ({"apiKey": "sk-short"}, "apiKey", "at least 16 characters (this one has 8)"),
        ({"apiKeys": {"alice": "fifteen-chars!!"}}, "apiKeys.alice", "at least 16 characters"),
        ({"apiKeys": {"alice": " "}}, "apiKeys.alice", "set but empty"),
        ({"apiKeys": {"alice": "sk-with a-space-000000"}}, "apiKeys.alice", "visible ASCII characters other than ','"),
        ({"apiKeys": {"alice": "sk-with-newline-00000\n"}}, "apiKeys.alice", "visible ASCII characters other than ','"),
        ({"apiKeys": {"alice": ""}}, "apiKeys.alice", "--path apiKeys.<name>"),
        ({"apiKeys": {"Alice": GOOD}}, "apiKeys.Alice", "a client name: a label"),
        ({"apiKeys": {"team a": GOOD}}, "apiKeys.team a", "a client name: a label"),
        ({"apiKeys": {"team_a": GOOD}}, "apiKeys.team_a", "a client name: a label"),
        ({"apiKeys": {"team.a": GOOD}}, "apiKeys.team.a", "a client name: a label"),
        ({"apiKeys": {"-team": GOOD}}, "apiKeys.-team", "a client name: a label"),
        ({"apiKeys": {"team-": GOOD}}, "apiKeys.team-", "a client name: a label"),
        ({"apiKeys": {"t" * 33: GOOD}}, "apiKeys." + "t" * 33, "at most 32 characters"),
        ({"apiKeys": {"équipe": GOOD}}, "apiKeys.équipe", "a client name: a label"),
        ({"apiKeys": {"default": GOOD}}, "apiKeys.default", "'default' is apiKey's"),
        ({"apiKeys": {"spark-vllm": GOOD}}, "apiKeys.spark-vllm", "the program's own"),
        ({"apiKeys": {"alice": GOOD, "bob": GOOD}}, "apiKeys.bob", "apiKeys.alice, apiKeys.bob are one key"),
        ({"apiKey": GOOD, "apiKeys": {"alice": GOOD}}, "apiKeys.alice", "apiKey, apiKeys.alice are one key"),
        ({"apiKeys": ["alice", GOOD]}, "apiKeys", "dictionary"),
        ({"apiKeys": {"alice": 12345678901234567}}, "apiKeys.alice", ""),
    ],
)
def test_a_bad_key_is_refused_naming_the_client_never_the_key(keys, path, expected):
    refused(config(**keys), path, expected)


def test_named_keys_are_clients_beside_apikeys_default():
    cfg = load_cluster_config(config(apiKey=GOOD, apiKeys={"alice": "sk-alice-0000000000000002", "ci-2": "x" * 16}))
    assert list(cfg.client_keys) == ["default", "alice", "ci-2"]


def test_named_keys_alone_are_keys_for_the_public_bind_rule():
    load_cluster_config(config(vllm__allowUnauthenticated=False, apiKeys={"alice": GOOD}))
    assert [p.split(":")[0] for p in problems(config(vllm__allowUnauthenticated=False))] == ["apiKey"]


def test_keys_and_the_certificate_held_in_plain_text_are_refused():
    for key, value in (("apiKeys", {"alice": GOOD}), ("tls", tls())):
        with pytest.raises(ConfigError) as caught:
            load_cluster_config(config(**{key: value}), plain={key})
        assert any(line.startswith(f"{key}: '[set in plain text]'") for line in caught.value.problems)


# --- the certificate -----------------------------------------------------------------------------------


def test_a_good_certificate_passes_for_the_heads_address_and_for_a_name_its_wildcard_covers():
    load_cluster_config(config(tls=tls()))
    named = config(nodes__0__host="spark-01.lab.example", tls=tls(CA.issue("*.lab.example")))
    load_cluster_config(named)
    self_signed = CA.issue(HEAD)
    load_cluster_config(config(tls={"certificate": self_signed.certificate, "key": self_signed.key, "ca": CA.pem}))


BAD_CERTIFICATES = [
    ("another name", lambda: tls(CA.issue("10.0.0.2", "spark-02.lan")), "tls.certificate",
     "a certificate for 10.0.0.1, the host the endpoint is reached at (it names spark-02.lan, 10.0.0.2)"),
    ("a name for an address", lambda: tls(CA.issue("spark-01.lan")), "tls.certificate", "a certificate for 10.0.0.1"),
    ("no subjectAltName", lambda: tls(CA.issue(HEAD, san=False)), "tls.certificate", "no subjectAltName at all"),
    ("a wildcard one level up", lambda: tls(CA.issue("*.0.0.1")), "tls.certificate", "a certificate for 10.0.0.1"),
    ("expired", lambda: tls(not_before=NOW - 30 * DAY, not_after=NOW - DAY), "tls.certificate", "expired"),
    ("not valid yet", lambda: tls(not_before=NOW + DAY), "tls.certificate", "is valid only from"),
    ("a client certificate", lambda: tls(usage=__import__("cryptography").x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH),
     "tls.certificate", "lacks serverAuth"),
    ("another certificate's key", lambda: {**tls(), "key": CA.issue(HEAD).key}, "tls.key", "another certificate's"),
    ("another CA", lambda: tls(ca=OTHER_CA), "tls.ca", "this CA did not sign it"),
    ("the key as the certificate", lambda: {**tls(), "certificate": tls()["key"]}, "tls.certificate", "PEM certificates"),
    ("a certificate as the key", lambda: {**tls(), "key": CA.pem}, "tls.key", "an unencrypted PEM private key"),
    ("no CA", lambda: {**tls(), "ca": "none"}, "tls.ca", "the PEM certificate of the CA"),
    ("a truncated certificate", lambda: {**tls(), "certificate": tls()["certificate"][:200]}, "tls.certificate",
     "PEM certificates"),
    ("the chain upside down", lambda: {**tls(), "certificate": CA.pem + tls()["certificate"]}, "tls.certificate",
     "a certificate for 10.0.0.1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "make", "path", "expected"), BAD_CERTIFICATES, ids=[row[0] for row in BAD_CERTIFICATES]
)
def test_a_bad_certificate_is_refused_before_anything_starts(name, make, path, expected):
    line = refused(config(tls=make()), path, expected)
    assert line.split(": ", 1)[1].startswith(("'[PEM]'", "'[secret]'")), line


def test_a_missing_part_of_tls_is_named():
    found = problems(config(tls={"certificate": tls()["certificate"]}))
    assert any(line.startswith("tls.key: None") for line in found) and any(
        line.startswith("tls.ca: None") for line in found
    )


def test_the_certificate_is_checked_for_the_routers_node_with_several_models():
    from tests.unit.test_deployments import config as fleet_config

    raw = fleet_config()
    router_node = load_cluster_config(raw).router.node
    host = next(node["host"] for node in raw["nodes"] if node["name"] == router_node)
    load_cluster_config({**raw, "tls": tls(CA.issue(host))})
    other = next(node["host"] for node in raw["nodes"] if node["name"] != router_node)
    refused({**raw, "tls": tls(CA.issue(other))}, "tls.certificate", f"a certificate for {host}")


def test_a_bad_certificate_is_listed_with_every_other_problem():
    """Where the endpoint is needs the whole config: with another key wrong, every check but the names runs."""
    expired = tls(not_before=NOW - 30 * DAY, not_after=NOW - DAY)
    found = problems(config(vllm__port=0, apiKeys={"alice": "short"}, tls=expired))
    assert [line.split(":")[0] for line in found] == ["vllm.port", "apiKeys.alice", "tls.certificate"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_the_readmes_openssl_recipe_makes_what_the_program_accepts(tmp_path):
    """docs/security.md's commands, run as written (the host named as the endpoint's)."""
    from tests.unit.test_readme import openssl_recipe

    for command in openssl_recipe(host=HEAD):
        subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, capture_output=True)
    read = {name: (tmp_path / name).read_text() for name in ("server.pem", "server.key", "ca.pem")}
    load_cluster_config(
        config(tls={"certificate": read["server.pem"], "key": read["server.key"], "ca": read["ca.pem"]})
    )
