"""Which lora_path values the API may load: real paths inside --adapter-dir, safetensors only."""

from __future__ import annotations

import os

import pytest

from mlc_lora.errors import LoraError
from mlc_lora.serve.adapters import AdapterRoots


def _adapter(folder, weights="adapter_model.safetensors"):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / weights).write_bytes(b"\0" * 8)
    return folder


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "adapters"
    good = _adapter(root / "good")
    outside = _adapter(tmp_path / "outside")
    _adapter(root / "pickle", weights="adapter_model.bin")
    os.symlink(outside, root / "link-out")  # a folder symlink leaving the root
    os.symlink(good, root / "link-in")  # one that stays inside
    leaky = root / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").write_text("{}")
    os.symlink(outside / "adapter_model.safetensors", leaky / "adapter_model.safetensors")
    return tmp_path, root, good


def test_inside_the_root_resolves_to_the_real_folder(tree):
    _, root, good = tree
    roots = AdapterRoots([root])
    assert roots.resolve(str(good)) == good.resolve()
    assert roots.resolve("good") == good.resolve()  # relative to a root
    assert roots.resolve(str(root / "link-in")) == good.resolve()
    assert roots.resolve(str(root / "pickle" / ".." / "good")) == good.resolve()


@pytest.mark.parametrize("path, needle", [
    ("{tmp}/outside", "outside the allowed adapter folders"),
    ("{root}/../outside", "outside the allowed adapter folders"),
    ("../outside", "outside the allowed adapter folders"),
    ("{root}/link-out", "outside the allowed adapter folders"),
    ("{root}/leaky", "resolves outside"),
    ("{root}/pickle", "adapter_model.bin"),
    ("{root}/missing", "not an adapter folder"),
    ("{root}/good/adapter_config.json", "not an adapter folder"),
    ("", "non-empty string"),
    ("/etc/passwd", "outside the allowed adapter folders"),
])
def test_refused_paths_name_the_problem(tree, path, needle):
    tmp, root, _ = tree
    with pytest.raises(LoraError, match=needle):
        AdapterRoots([root]).resolve(path.format(tmp=tmp, root=root))


def test_no_roots_disables_api_loading_and_bad_roots_are_refused(tree, tmp_path):
    _, _, good = tree
    with pytest.raises(LoraError, match="--adapter-dir"):
        AdapterRoots([]).resolve(str(good))
    with pytest.raises(LoraError, match="is not a folder"):
        AdapterRoots([tmp_path / "nope"])


def test_a_relative_path_is_looked_up_in_every_root(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _adapter(first / "a")
    b = _adapter(second / "b")
    _adapter(second / "a")
    roots = AdapterRoots([first, second])
    assert roots.resolve("b") == b.resolve()  # only in the second root
    assert roots.resolve("a") == (first / "a").resolve()  # in both: the first root wins
    with pytest.raises(LoraError, match="outside the allowed adapter folders"):
        roots.resolve("missing")


def test_find_by_name_looks_only_at_folders_directly_in_a_root(tree):
    tmp, root, good = tree
    roots = AdapterRoots([root])
    assert roots.find("good") == good.resolve()
    assert roots.find("link-in") == good.resolve()  # a symlink that stays inside
    for name in ("missing", "..", ".", "good/..", "../outside", str(good), "a\\b", "a\x00b", ""):
        assert roots.find(name) is None, name  # nothing there, or not a plain folder name
    with pytest.raises(LoraError, match="outside"):
        roots.find("link-out")  # a folder of that name that leaves the root
    with pytest.raises(LoraError, match="pickle"):
        roots.find("pickle")
    assert AdapterRoots([]).find("good") is None  # no --adapter-dir: nothing is looked up
