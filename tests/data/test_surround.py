"""Synthetic surround scenes: camera geometry by hand, rendering of a hand-built scene, ego-motion aligned
previous frames, visibility filtering, determinism, errors, and an empty scene that trains."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_spatial.data import SurroundScenes, SurroundSynthetic, surround
from lightning_spatial.data.render import CLASS_COLOURS, HORIZON, Scene, render
from lightning_spatial.data.surround import labelled

SUN_FROM_FRONT = torch.tensor([-1.0, 0.0, 0.0])  # lights faces that look back at the ego vehicle fully


def _pixel(lidar2img: torch.Tensor, point) -> tuple[int, int]:
    p = lidar2img.double() @ torch.tensor([*point, 1.0], dtype=torch.float64)
    return round(p[1].item() / p[2].item()), round(p[0].item() / p[2].item())  # (row, column)


def test_front_camera_projects_as_computed_by_hand():
    ds = SurroundScenes(1, 32, 88, cameras=1)
    f = 44 / math.tan(math.radians(35))  # 70 degree field of view over 88 columns
    # CAM_FRONT sits at (1.70, 0.02, 1.51) looking along +x: a point 10 m ahead, 1 m left, 1 m lower
    point = torch.tensor([11.70, 1.02, 0.51, 1.0])
    expected = torch.tensor([(43.5 - f / 10) * 10, (15.5 + f / 10) * 10, 10.0, 1.0])
    torch.testing.assert_close(ds.lidar2img[0] @ point, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("index, yaw", [(1, 55), (3, 180), (5, -110)])
def test_each_camera_looks_along_its_yaw(index, yaw):
    ds = SurroundScenes(1, 32, 88)
    mount = ds.cam2ego[index, :3, 3]
    ahead = mount + 10 * torch.tensor([math.cos(math.radians(yaw)), math.sin(math.radians(yaw)), 0.0])
    projected = ds.lidar2img[index] @ torch.cat([ahead, torch.ones(1)])
    torch.testing.assert_close(projected, torch.tensor([43.5 * 10, 15.5 * 10, 10.0, 1.0]), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("yaw, face", [(math.pi, "front"), (0.0, "back")])
def test_renders_the_face_towards_the_camera_with_its_colour(yaw, face):
    ds = SurroundScenes(1, 32, 88, cameras=1)
    car = torch.tensor([[12.0, 0.0, 0.8, 1.9, 4.6, 1.6, yaw, 0.0, 0.0]])
    image = render(Scene(car, torch.tensor([0]), 0, SUN_FROM_FRONT), ds.intrinsics, ds.cam2ego, ds.size)[0]
    base = CLASS_COLOURS[0]
    colour = 0.4 * base + 0.6 if face == "front" else 0.5 * base  # faces lit head-on (shade 1)
    fog = math.exp(-(12.0 - 2.3 - 1.70) / 150)  # the face 2.3 m before the centre, depth from the camera
    expected = torch.round(255 * (HORIZON + (colour - HORIZON) * fog))
    row, column = _pixel(ds.lidar2img[0], (12.0, 0.0, 0.8))
    torch.testing.assert_close(image[:, row, column].float(), expected, atol=1, rtol=0)


def test_previous_frame_shows_objects_where_prev_lidar2img_puts_them(monkeypatch):
    """A small box moving sideways at 8 m/s: 0.5 s earlier it was 4 m to the right; prev_lidar2img (which
    includes the ego motion) must find it there in the previous images, and ground where it is now."""
    box = torch.tensor([[15.0, 2.0, 0.9, 1.0, 1.0, 1.8, math.pi / 2, 0.0, 8.0]])
    scene = Scene(box, torch.tensor([0]), 3, SUN_FROM_FRONT)
    monkeypatch.setattr(surround, "sample_scene", lambda g, *args: scene)
    sample = SurroundScenes(1, 64, 176, cameras=1, temporal=True)[0]
    assert not torch.equal(sample["prev_lidar2img"], sample["lidar2img"])  # the ego vehicle moved

    def red(images, lidar2img, point):
        row, column = _pixel(lidar2img[0], point)
        r, g, _ = images[0, :, row, column].tolist()
        return r - g > 60

    now, before = (15.0, 2.0, 0.9), (15.0, -2.0, 0.9)
    assert red(sample["images"], sample["lidar2img"], now)
    assert not red(sample["images"], sample["lidar2img"], before)
    assert red(sample["prev_images"], sample["prev_lidar2img"], before)
    assert not red(sample["prev_images"], sample["prev_lidar2img"], now)


def test_ground_texture_is_fixed_in_the_world(monkeypatch):
    """Ground points seen in both frames keep their colour (up to a little haze), which ties the images to
    the ego motion; the same points shifted by 2.5 m (other texture cells) do not."""
    scene = Scene(torch.zeros(0, 9), torch.zeros(0, dtype=torch.long), 11, SUN_FROM_FRONT)
    monkeypatch.setattr(surround, "sample_scene", lambda g, *args: scene)
    sample = SurroundScenes(1, 64, 176, cameras=1, temporal=True)[0]
    g = torch.Generator().manual_seed(0)
    points = torch.stack([8 + 8 * torch.rand(200, generator=g), 4 * torch.rand(200, generator=g) - 2], 1)

    def colours(images, lidar2img, xy):
        pixels = [_pixel(lidar2img[0], (x, y, 0.0)) for x, y in xy.tolist()]
        return torch.stack([images[0, :, row, column].float() for row, column in pixels])

    now = colours(sample["images"], sample["lidar2img"], points)
    same = (colours(sample["prev_images"], sample["prev_lidar2img"], points) - now).abs().median()
    shifted = (colours(sample["prev_images"], sample["prev_lidar2img"], points + 2.5) - now).abs().median()
    assert same <= 3 < 6 < shifted


def test_labels_keep_boxes_seen_by_a_camera_and_in_range():
    ds = SurroundScenes(1, 32, 88, cameras=1)
    boxes = torch.zeros(4, 9)
    boxes[:, :3] = torch.tensor([[20.0, 0.0, 0.8], [-20.0, 0.0, 0.8], [55.0, 0.0, 0.8], [30.0, 0.0, 4.0]])
    # ahead; behind the only camera; ahead but beyond the 51.2 m range; in view but above the 3 m range
    assert labelled(boxes, ds.lidar2img, ds.size).tolist() == [True, False, False, False]


def test_samples_are_deterministic_per_seed_and_index():
    a, b = SurroundScenes(8, 32, 88, temporal=True), SurroundScenes(8, 32, 88, temporal=True)
    for key, value in a[3].items():
        assert torch.equal(value, b[3][key]), key
    assert not torch.equal(a[3]["images"], a[4]["images"])
    assert not torch.equal(a[3]["images"], SurroundScenes(8, 32, 88, seed=1)[3]["images"])


def test_scenes_have_several_classes_moving_objects_and_empty_scenes():
    ds = SurroundScenes(40, 8, 22, max_objects=12)
    samples = [ds[i] for i in range(len(ds))]
    labels = torch.cat([s["labels"] for s in samples])
    boxes = torch.cat([s["boxes"] for s in samples])
    assert len(labels.unique()) >= 6 and (boxes[:, 7:].norm(dim=1) > 0.5).any()
    assert any(len(s["boxes"]) == 0 for s in samples)  # 0..max_objects objects per scene
    empty = SurroundScenes(1, 8, 22, max_objects=0)[0]
    assert empty["boxes"].shape == (0, 9) and empty["labels"].shape == (0,)


def test_distance_bounds_how_far_from_the_ego_vehicle_objects_stand():
    """Every object's ground distance lies in (near, far), here through the DataModule as Hydra builds it; by
    default 6-48 m."""
    train, val = SurroundSynthetic(num_samples=12, val_samples=4, height=8, width=22, max_objects=10,
                                   distance=[10, 14]).datasets()  # fmt: skip
    near = torch.cat([s["boxes"] for s in (*train, *val)])[:, :2].norm(dim=1)
    assert len(near) > 20 and 10 - 1e-4 <= near.min() and near.max() <= 14 + 1e-4
    g = torch.Generator().manual_seed(0)
    default = torch.cat([surround.sample_scene(g, 20).boxes for _ in range(10)])[:, :2].norm(dim=1)
    assert 6 - 1e-4 <= default.min() < 10 and 40 < default.max() <= 48 + 1e-4
    with pytest.raises(ValueError, match=r"distance=\(14, 10\): give \(near, far\) metres"):
        SurroundScenes(1, 8, 22, distance=(14, 10))


@pytest.mark.parametrize("cameras", [7, 0, ["CAM_FRONT", "CAM_ROOF"]])
def test_a_camera_count_the_rig_does_not_calibrate_raises(cameras):
    with pytest.raises(ValueError, match=r"the synthetic rig calibrates 6 cameras"):
        SurroundScenes(1, 32, 88, cameras=cameras)


class _Toy(L.LightningModule):
    """Pools each camera's image and regresses one box per sample towards the labelled boxes (none here)."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 9)

    def training_step(self, batch, _):
        b, n = batch["images"].shape[:2]
        pred = self.head(self.conv(batch["images"].flatten(0, 1)).mean((2, 3)).view(b, n, -1).mean(1))
        assert all(len(boxes) == 0 for boxes in batch["boxes"])
        return sum((p[None] - boxes).pow(2).sum() for p, boxes in zip(pred, batch["boxes"])) + pred.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_empty_scenes_train():
    data = SurroundSynthetic(num_samples=4, val_samples=1, height=16, width=44, cameras=2, max_objects=0, batch_size=2)
    model = _Toy()
    before = model.head.weight.detach().clone()
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1)  # fmt: skip
    trainer.fit(model, data)
    assert trainer.global_step == 2 and not torch.equal(before, model.head.weight)


def test_a_class_subset_draws_only_those_classes_indexed_in_the_subset():
    classes = ["pedestrian", "car"]
    scenes = SurroundScenes(24, 16, 44, max_objects=6, classes=classes)
    labels = torch.cat([scenes[i]["labels"] for i in range(len(scenes))])
    boxes = torch.cat([scenes[i]["boxes"] for i in range(len(scenes))])
    assert set(labels.tolist()) == {0, 1}
    length = boxes[:, 4]  # cars are ~4.6 m long, pedestrians ~0.7 m (surround.SIZES)
    assert (length[labels == 1] > 4).all() and (length[labels == 0] < 1).all()
    with pytest.raises(ValueError, match="non-empty subset of"):
        SurroundScenes(4, 16, 44, classes=["car", "tram"])
