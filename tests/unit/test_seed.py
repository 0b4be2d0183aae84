"""The rehearsal's node seed (tests/e2e/seed.py) follows the image archive it was made from: a seed of one build
is not planted beside nodes that pull another build of the same sources."""

import contextlib
from pathlib import Path

from tests.e2e import seed
from tests.e2e.image.build import ImageInfo


def _fakes(monkeypatch, archive_id: str, made: list):
    monkeypatch.setattr(seed, "_archive_id", lambda cache_dir: archive_id)

    @contextlib.contextmanager
    def dockerd(prefix, data_root, config):
        Path(data_root).mkdir(parents=True, exist_ok=True)
        yield "unix:///fake.sock"

    def publish(cache_dir, registry, host):
        made.append(archive_id)
        return ImageInfo(ref=f"{registry}/spark-vllm-rehearsal:x", archive=Path("/nowhere"), image_id=archive_id)

    monkeypatch.setattr(seed, "private_dockerd", dockerd)
    monkeypatch.setattr(seed, "publish", publish)
    monkeypatch.setattr(seed, "docker", lambda *args, **kwargs: None)


def test_a_seed_is_reused_while_the_archive_is_the_build_it_holds(monkeypatch, tmp_path):
    made: list = []
    _fakes(monkeypatch, "sha256:aaa", made)
    first = seed.image_seed(tmp_path, "10.76.199.1:5000")
    again = seed.image_seed(tmp_path, "10.76.199.1:5000")
    assert first == again and made == ["sha256:aaa"]


def test_a_seed_is_made_again_once_the_archive_is_another_build(monkeypatch, tmp_path):
    made: list = []
    _fakes(monkeypatch, "sha256:aaa", made)
    seed.image_seed(tmp_path, "10.76.199.1:5000")
    _fakes(monkeypatch, "sha256:bbb", made)  # the archive evicted and built again: another id
    seed.image_seed(tmp_path, "10.76.199.1:5000")
    assert made == ["sha256:aaa", "sha256:bbb"]
    complete = next(tmp_path.glob("seeds/*/complete")).read_text().split()
    assert complete[1] == "sha256:bbb"


def test_a_seed_made_before_it_named_its_build_is_made_again(monkeypatch, tmp_path):
    made: list = []
    _fakes(monkeypatch, "sha256:aaa", made)
    seed.image_seed(tmp_path, "10.76.199.1:5000")
    marker = next(tmp_path.glob("seeds/*/complete"))
    marker.write_text(marker.read_text().split()[0] + "\n")  # as seeds made before 2026-12-04 hold it
    seed.image_seed(tmp_path, "10.76.199.1:5000")
    assert made == ["sha256:aaa", "sha256:aaa"]
