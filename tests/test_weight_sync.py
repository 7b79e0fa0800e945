"""The filesystem weight sync: complete versions only, marked STABLE last, old ones pruned."""

from i3core.testing import make_component


def test_publish_marks_stable_and_keeps_the_newest(builtins, tmp_path):
    sync = make_component("weight_sync", "filesystem", plugins=builtins, keep=2)
    seen_during_save = []

    def save(directory):
        seen_during_save.append(sync.is_ready(tmp_path, version))
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"x")

    for version in range(4):
        path = sync.publish(tmp_path, version, save)
        assert sync.is_ready(tmp_path, version) and (path / "model.safetensors").exists()
    assert seen_during_save == [False] * 4  # never ready before it is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]


def test_republishing_a_version_replaces_it(builtins, tmp_path):
    sync = make_component("weight_sync", "filesystem", plugins=builtins)
    sync.publish(tmp_path, 0, lambda d: (d.mkdir(parents=True), (d / "a").write_text("old")))
    sync.publish(tmp_path, 0, lambda d: (d.mkdir(parents=True), (d / "a").write_text("new")))
    assert (sync.location(tmp_path, 0) / "a").read_text() == "new"
