"""tests/e2e/upgrade_preview.py's --set: config merged into the older stack's file as a user's edit would."""

from __future__ import annotations

import pytest

from tests.e2e.upgrade_preview import _runs_in, with_settings


def test_a_dotted_key_goes_into_its_section_and_keeps_the_others():
    document = {"config": {"spark-vllm:network": {"mtu": 9000}, "spark-vllm:model": "/models/m"}}
    merged = with_settings(document, ["network.guard=true", 'imageTransfer.method="copy"', "a=1"])
    assert merged["config"]["spark-vllm:network"] == {"mtu": 9000, "guard": True}
    assert merged["config"]["spark-vllm:imageTransfer"] == {"method": "copy"}
    assert merged["config"]["spark-vllm:a"] == 1 and merged["config"]["spark-vllm:model"] == "/models/m"


def test_a_deeper_key_makes_the_sections_it_needs():
    merged = with_settings({"config": {}}, ["vllm.speculative.tokens=2"])
    assert merged["config"]["spark-vllm:vllm"] == {"speculative": {"tokens": 2}}


@pytest.mark.parametrize("setting", ["network.guard", "=true", "network.guard=yes"])
def test_a_setting_that_is_not_key_equals_json_is_refused(setting):
    with pytest.raises(ValueError):
        with_settings({"config": {}}, [setting])


def test_a_vllm_in_a_replaced_container_counts_as_restarted_whatever_its_pid():
    assert _runs_in("big-serve", "big-node-1-container") and _runs_in("spark-vllm-serve", "node-2-container")
    assert not _runs_in("small-serve", "small-2-node-3-container")  # another replica of the deployment
    assert not _runs_in("big-serve", "node-1-edge") and not _runs_in("spark-vllm-serve", "spark-vllm-router")
