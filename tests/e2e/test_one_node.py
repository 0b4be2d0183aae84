"""The one-node shape (Pulumi.dev.yaml: one machine, no fabric peer, TP 1) through the real CLI, language host
and plugins: a new stack's first `pulumi preview`, its `pulumi up` serving through the edge, then a preview that
changes nothing and a destroy that leaves nothing. The shapes of the other example stack files are the other
rehearsal modules' (two nodes at TP 2: test_rehearsal.py; three nodes with deployments and the router:
test_deployments.py; MTP: test_speculative.py)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import _cluster, _image
from tests.e2e.observe import no_containers
from tests.e2e.rehearsal import chat, rehearsal_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def one_node(registry, tmp_path_factory, request):
    yield from _cluster(1, registry, tmp_path_factory, request)


def test_one_node_previews_deploys_serves_and_destroys(one_node, model_dir, new_stack):
    image = _image(one_node)
    stack = new_stack("dev")
    config, secrets = rehearsal_config(one_node, image.ref, model_dir, tensorParallelSize=1)
    stack.configure(config, secrets)
    preview = stack.preview()
    assert preview.changed and set(preview.changed.values()) == {"create"}, preview.changed
    run = stack.up()
    assert set(run.changed) == set(preview.changed)
    assert chat(run.outputs["endpoint"], secrets["apiKey"], run.outputs["servedModelName"])["choices"]
    assert stack.preview().changed == {}
    stack.destroy()
    assert no_containers(one_node) and not stack.holds_resources()
