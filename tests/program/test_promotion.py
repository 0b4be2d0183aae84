"""Promotion under mocks: a stack deploys another stack's validated release, by digest, or nothing."""

import json

import pytest

from tests.harness import CONTAINER, IMAGE, FakeCloud, changed_inputs, run_program
from tests.program.test_program import SECRETS, prod

STAGING = "organization/spark-vllm/staging"
DIGEST = "hellohal2064/vllm-qwen3.5-gb10@sha256:" + "12" * 32


def release(**changes) -> dict:
    value = {
        "image": DIGEST,
        "model": "/models/Qwen3.5-122B-A10B-FP8",
        "engine": {
            "maxModelLen": 16384,
            "reasoningParser": "qwen3",
            "toolCallParser": "qwen3_coder",
            "enableAutoToolChoice": True,
            "trustRemoteCode": True,
            "extraArgs": [],
        },  # fmt: skip
        "validated": True,
        "fingerprint": "abc",
        "promotedFrom": "config",
    }
    value.update(changes)
    return value


def promoted(**changes) -> dict:
    cfg = prod(promoteFrom=STAGING, **changes)
    del cfg["image"], cfg["model"]
    return cfg


def staging_cloud(staging_release) -> FakeCloud:
    return FakeCloud(stack_outputs={STAGING: {"release": staging_release} if staging_release is not None else {}})


def run_promoted(staging_release, cfg=None, cloud=None):
    return run_program(cfg or promoted(), SECRETS, stack="prod", mocks=cloud or staging_cloud(staging_release))


def test_a_validated_release_is_deployed_by_digest_with_its_engine_settings():
    run = run_promoted(release())
    assert {r.inputs["name"] for r in run.of_type(IMAGE) if not r.name.endswith("-edge-image")} == {DIGEST}
    serve = run.named("spark-vllm-serve")
    params = json.loads(json.loads(serve.inputs["stdin"].split("\n", 1)[0].split("=", 1)[1]))
    assert params["argv"][2] == "/models/Qwen3.5-122B-A10B-FP8"
    assert "--max-model-len=16384" in params["argv"]  # the release's, not the stack file's 32768
    assert run.exports["release"]["promotedFrom"] == STAGING
    assert run.exports["release"]["engine"]["maxModelLen"] == 16384


@pytest.mark.parametrize(
    ("staging_release", "message"),
    [
        (None, "that stack has no `release` output"),
        (release(validated=False), "is not validated"),
        (release(image="hellohal2064/vllm-qwen3.5-gb10:latest"), "is not pinned by digest"),
        ({"model": "/models/x", "validated": True}, "its release lacks ['image']"),
        (release(image="sha256:" + "34" * 32), "has no registry digest .*or set imageTransfer.method: copy"),
    ],
    ids=["missing", "unvalidated", "tag-not-digest", "incomplete", "bare-image-id"],
)
def test_a_release_that_cannot_be_promoted_creates_nothing_that_depends_on_it(staging_release, message):
    cloud = staging_cloud(staging_release)
    with pytest.raises(
        Exception, match=f"promoteFrom '{STAGING}': .*{message}".replace("[", r"\[").replace("]", r"\]")
    ):
        run_promoted(staging_release, cloud=cloud)
    assert IMAGE not in cloud.created and CONTAINER not in cloud.created
    assert "command:remote:Command" not in cloud.created


def test_setting_image_or_model_beside_promote_from_is_refused():
    from components.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        run_program(prod(promoteFrom=STAGING), SECRETS, stack="prod")
    assert [p.split(":")[0] for p in caught.value.problems] == ["image", "model"]


def test_promoting_a_new_release_changes_exactly_what_it_changes():
    first = run_promoted(release())
    second = run_promoted(release(engine={**release()["engine"], "maxModelLen": 8192}))
    # vLLM's arguments change (serve's stdin), readiness and smoke run again (their triggers)
    assert changed_inputs(first, second) == {
        "spark-vllm-serve": {"stdin"},
        "spark-vllm-ready": {"triggers"},
        "spark-vllm-smoke": {"triggers"},
        "spark-vllm-benchmark": {"triggers"},
    }
    rollback = run_promoted(release(image="hellohal2064/vllm-qwen3.5-gb10@sha256:" + "34" * 32))
    changed = changed_inputs(first, rollback)
    assert changed["spark-01-image"] == changed["spark-02-image"] == {"name"}
    assert not any(name.endswith("-docker") for name in changed)


def test_topology_stays_per_stack():
    run = run_promoted(release(), cfg=promoted(vllm={"port": 31000, "gpuMemoryUtilization": 0.8}))
    assert run.exports["endpoint"] == "http://spark-01.lan:31000/v1"


def test_a_pinned_fingerprint_deploys_that_release_and_refuses_another():
    pinned = "00000000000000ab"
    run = run_promoted(release(fingerprint=pinned), cfg=promoted(promoteFingerprint=pinned))
    assert {r.inputs["name"] for r in run.of_type(IMAGE) if not r.name.endswith("-edge-image")} == {DIGEST}
    moved_on = release(fingerprint="00000000000000cd")
    cloud = staging_cloud(moved_on)
    with pytest.raises(
        Exception, match=f"its release is now 00000000000000cd, not the pinned promoteFingerprint {pinned}"
    ):
        run_promoted(moved_on, cfg=promoted(promoteFingerprint=pinned), cloud=cloud)
    assert IMAGE not in cloud.created and CONTAINER not in cloud.created


def test_a_pinned_fingerprint_needs_promote_from():
    from components.config import ConfigError

    with pytest.raises(ConfigError, match="promoteFingerprint: '00000000000000ab' — promoteFrom beside it"):
        run_program(prod(promoteFingerprint="00000000000000ab"), SECRETS, stack="prod")


def test_a_copied_image_is_promoted_by_id_to_a_stack_that_copies_too():
    image_id = "sha256:" + "34" * 32
    run = run_promoted(release(image=image_id), cfg=promoted(imageTransfer={"method": "copy"}))
    # the copy source must hold that id (its pull step says so when it does not); the others receive it
    assert run.named("spark-01-image").inputs["name"] == image_id
    pull = json.loads(json.loads(run.named("spark-01-pull").inputs["stdin"].split("\n", 1)[0].split("=", 1)[1]))
    assert pull["image"] == image_id
    assert "spark-02-image-copy" in {r.name for r in run.registrations}
