"""The cross-field rules' runner: a rule runs on the keys it declares, only where they are valid."""

from __future__ import annotations

import pytest

from components.config import load_cluster_config
from components.config.models import ClusterConfig
from components.config.runner import RULES, UndeclaredKeyError, View, failed_keys, partial, run
from tests.unit.test_config import config


def test_a_rule_that_reads_a_key_it_did_not_declare_fails_loudly():
    cfg = load_cluster_config(config())
    view = View(cfg, frozenset({"vllm.host"}))
    assert str(view.vllm.host) == "0.0.0.0"
    with pytest.raises(UndeclaredKeyError, match="vllm.port"):
        view.vllm.port  # noqa: B018
    with pytest.raises(UndeclaredKeyError, match="ray"):
        view.ray  # noqa: B018


def test_the_keys_that_failed_are_named_as_rules_declare_them():
    raw = config(vllm__port=0, nodes__1__name="Bad_Name", fabric="not an object")
    assert failed_keys(partial(ClusterConfig, raw)) == {"vllm.port", "nodes[].name", "fabric"}


def test_a_rule_whose_key_failed_is_skipped_and_the_others_run():
    raw = config(recovery__backoffSeconds=30, recovery__maxBackoffSeconds=10, vllm__host="nope", apiKey=None)
    del raw["apiKey"]
    raw["vllm"]["allowUnauthenticated"] = False
    problems = run(partial(ClusterConfig, raw))
    assert any(p.startswith("recovery.maxBackoffSeconds") for p in problems)
    assert not any(p.startswith("apiKey") for p in problems)  # it reads vllm.host, which failed


def test_a_node_rule_sees_the_nodes_whose_keys_are_valid():
    raw = config(nodes__0__name="Bad_Name", nodes__1__fabricAddress="10.9.0.1")
    raw["nodes"].append({"name": "spark-03", "host": "10.0.0.3", "fabricAddress": "10.9.0.1", "fabricInterface": "x"})
    problems = run(partial(ClusterConfig, raw))
    # the first node's address is valid although its name is not: the duplicate is still found
    assert "nodes[1].fabricAddress: '10.9.0.1' — a unique address (nodes[0] has it)" in problems


@pytest.mark.parametrize("each", RULES, ids=lambda each: each.name)
def test_every_rule_declares_keys_the_config_has(each):
    from components.config import config_keys

    known = {path.replace("[]", "[]") for path, _ in config_keys()}
    for key in each.keys:
        assert key.replace("[*]", "[]") in known, key
