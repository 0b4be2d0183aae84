"""tests/e2e/upgrade_preview.py's --set: config merged into the older stack's file as a user's edit would."""

from __future__ import annotations

import pytest

from tests.e2e.upgrade_preview import with_settings


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
