"""Fixtures of the rehearsal: simulated nodes, the image, and a deployment engine per cluster."""

from __future__ import annotations

import pytest

from tests.e2e import nodes as simnodes
from tests.e2e.engine import Deployment
from tests.e2e.image.build import ensure_image
from tests.e2e.rehearsal import CACHE_DIR, make_model

sim_cluster = simnodes.sim_cluster_fixture(2, scope="module", name="sim_cluster")
sim_cluster3 = simnodes.sim_cluster_fixture(3, scope="module", name="sim_cluster3")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rehearsal-models"))


def _deployment(cluster, tmp_path_factory, stack="rehearsal") -> tuple[Deployment, object]:
    image = ensure_image(CACHE_DIR, cluster.nodes[0].docker_host)
    workdir = tmp_path_factory.mktemp(f"engine-{stack}")
    return Deployment(workdir, {image.ref: image.archive}, stack=stack), image


@pytest.fixture(scope="module")
def rehearsal(sim_cluster, tmp_path_factory):
    deployment, image = _deployment(sim_cluster, tmp_path_factory)
    yield deployment, image
    deployment.destroy()  # whatever a test left behind


@pytest.fixture(scope="module")
def rehearsal3(sim_cluster3, tmp_path_factory):
    deployment, image = _deployment(sim_cluster3, tmp_path_factory)
    yield deployment, image
    deployment.destroy()
