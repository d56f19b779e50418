"""``model.checkpoint_path`` loads local timm weights (no hub): files written here, weights compared."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import save_file

from lightning_spatial.models import ImageTask


def _weights(path, num_classes: int, suffix: str) -> dict[str, torch.Tensor]:
    """A convnext_atto state_dict with random values (not timm's init), saved as ``path``."""
    torch.manual_seed(1)
    state = timm.create_model("convnext_atto", pretrained=False, num_classes=num_classes).state_dict()
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    return state


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_fine_tuned_checkpoint_loads_whole(tmp_path, suffix):
    """Backbone and head: a head of our size is the user's own, not ImageNet's, and must not be dropped."""
    path = tmp_path / f"w{suffix}"
    state = _weights(path, 3, suffix)
    loaded = ImageTask("convnext_atto", num_classes=3, checkpoint_path=str(path)).backbone.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_head_of_another_size_is_dropped_and_the_backbone_loads(tmp_path):
    path = tmp_path / "imagenet.safetensors"
    state = _weights(path, 1000, ".safetensors")
    loaded = ImageTask("convnext_atto", num_classes=3, checkpoint_path=str(path)).backbone.state_dict()
    head = {"head.fc.weight", "head.fc.bias"}
    assert all(torch.equal(loaded[k], state[k]) for k in state.keys() - head)
    assert loaded["head.fc.weight"].shape == (3, 320)


def test_segmentation_loads_the_backbone_features(tmp_path):
    """features_only renames the top modules (stem.0 -> stem_0, stages.3 -> stages_3)."""
    path = tmp_path / "w.safetensors"
    state = _weights(path, 3, ".safetensors")
    loaded = ImageTask("convnext_atto", "segmentation", num_classes=4, checkpoint_path=str(path)).backbone.state_dict()
    assert len(loaded) == len(state) - 4  # all but the classifier head's norm and fc
    assert all(torch.equal(v, state[k.replace("_", ".", 1)]) for k, v in loaded.items())


def test_a_missing_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint_path .*nope.safetensors"):
        ImageTask("convnext_atto", checkpoint_path=str(tmp_path / "nope.safetensors"))


@pytest.mark.parametrize("key, value", [("task", "detection"), ("optimizer", "lamb")])
def test_bad_choices_name_the_key_and_the_allowed_values(key, value):
    with pytest.raises(ValueError, match=rf"{key} must be one of \(.*\), got '{value}'"):
        ImageTask("convnext_atto", **{key: value})
