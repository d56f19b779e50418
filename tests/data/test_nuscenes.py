"""The nuScenes reader on a tiny folder in the devkit's format that the test writes: 3 key frames of one
scene, 6 cameras (solid-colour JPEGs, one colour per camera), a lidar ego pose and a few annotations.

The ego vehicle drives along global +y (yaw 90 degrees) at 2 m/s; each camera's ego pose is 1 m further on
than the lidar's. A car keeps pace 11.5 m ahead (so it is still in the ego frame but moves at 2 m/s)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from lightning_spatial.data import ATTRIBUTES, CAMERAS, CLASSES, NuScenes, NuScenesSurround
from tests.data.nuscenes_folder import COLOURS, NuScenesFolder, yaw_quaternion

YAW90 = yaw_quaternion(math.pi / 2)


def _annotation(folder, token, k, instance, ego_xyz, yaw_deg=120.0, size=(1.9, 4.5, 1.6), **kwargs):
    x, y, z = ego_xyz  # ego frame of key frame k: global = R(90 deg) @ (x, y) + (100, 200 + k)
    translation = [100 - y, 200 + k + x, z]
    return folder.annotation(token, f"s{k}", instance, translation, size, yaw_quaternion(math.radians(yaw_deg)),
                             **kwargs)  # fmt: skip


def write_nuscenes(root, size=(90, 160)):
    folder = NuScenesFolder(image_size=size)
    poses = [({"translation": [100, 200 + k, 0], "rotation": YAW90},
              {"translation": [100, 201 + k, 0], "rotation": YAW90}) for k in range(3)]  # fmt: skip
    folder.scene("sc0", "scene-0001", [(f"s{k}", 500_000 * k, *poses[k]) for k in range(3)])
    sweep = dict(folder.tables["sample_data"][0], token="sweep", is_key_frame=False, filename="sweeps/CAM_FRONT/x.jpg")
    folder.tables["sample_data"].append(sweep)
    car, bus, bike = (folder.instance(f"inst-{c}", c) for c in ("vehicle.car", "vehicle.bus.rigid", "vehicle.bicycle"))
    ped, dog = folder.instance("inst-ped", "human.pedestrian.adult"), folder.instance("inst-dog", "animal")
    high, rack = folder.instance("inst-high", "vehicle.car"), folder.instance("inst-rack", "static_object.bicycle_rack")
    moving = "vehicle.moving"
    folder.track([_annotation(folder, f"car{k}", k, car, (11.5, 0.5, 1.0), attribute=moving) for k in range(3)])
    _annotation(folder, "far1", 1, car, (60.0, 0.0, 1.0))  # beyond the 51.2 m range
    _annotation(folder, "ped1", 1, ped, (8.0, -3.0, 0.9), lidar=0)  # no lidar/radar points
    _annotation(folder, "bus1", 1, bus, (-20.0, -5.0, 1.5), yaw_deg=90.0, lidar=0, radar=3)
    _annotation(folder, "dog1", 1, dog, (6.0, 2.0, 0.3))  # not a detection class
    _annotation(folder, "high1", 1, high, (15.0, -4.0, 4.5), yaw_deg=90.0)  # above z = 3 m: kept, as the devkit does
    _annotation(folder, "rack1", 1, rack, (5.0, 8.0, 0.5), yaw_deg=90.0, size=(1.0, 4.0, 1.0), lidar=0)
    _annotation(folder, "bike1", 1, bike, (6.0, 8.0, 0.6), attribute="cycle.without_rider")  # in the rack
    return folder.write(root)


@pytest.fixture
def root(tmp_path):
    return write_nuscenes(tmp_path / "nuscenes")


def _project(lidar2img, point):
    return lidar2img.double() @ torch.tensor([*point, 1.0], dtype=torch.float64)


def test_cam_front_projects_a_box_centre_to_the_hand_computed_pixel(root):
    sample = NuScenesSurround(root, height=30, width=80)[1]
    # CAM_FRONT 1.5 m ahead of its ego pose, which is 1 m ahead of the lidar's: the car centre (11.5, 0.5, 1.0)
    # is 9 m in front of it, 0.5 m left, 0.5 m lower: u = 80 - 100 * 0.5 / 9, v = 45 + 100 * 0.5 / 9 at
    # 160x90; resized by (1/2, 1/3) with pixel centres: u' = (u + 0.5) / 2 - 0.5, v' = (v + 0.5) / 3 - 0.5
    u, v = 80 - 50 / 9, 45 + 50 / 9
    expected = torch.tensor([((u + 0.5) / 2 - 0.5) * 9, ((v + 0.5) / 3 - 0.5) * 9, 9.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(_project(sample["lidar2img"][0], (11.5, 0.5, 1.0)), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sample["cam2ego"][0, :3, 3], torch.tensor([2.5, 0.0, 1.5]))
    assert sample["images"].shape == (6, 3, 30, 80) and sample["images"].dtype == torch.uint8
    for i, name in enumerate(CAMERAS):  # each camera's own file, in CAMERAS order
        torch.testing.assert_close(sample["images"][i, :, 15, 40].float(), torch.tensor(COLOURS[name]).float(),
                                   atol=3, rtol=0)  # fmt: skip


def test_boxes_classes_yaw_velocity_attributes_and_filters(root):
    sample = NuScenesSurround(root, height=30, width=80)[1]
    # kept: the car, the bus (radar points only), the car 4.5 m up, the bicycle in the rack; dropped: out of
    # range, no points, an animal
    assert [CLASSES[i] for i in sample["labels"]] == ["car", "bus", "car", "bicycle"]
    # car: global yaw 120 deg -> 30 deg in the ego frame (yaw 90); global velocity (0, 2) -> (2, 0) in ego.
    # Lone annotations have no velocity: NaN, as the devkit's box_velocity.
    nan = float("nan")
    car = [11.5, 0.5, 1.0, 1.9, 4.5, 1.6, math.radians(30), 2.0, 0.0]
    bus = [-20.0, -5.0, 1.5, 1.9, 4.5, 1.6, 0.0, nan, nan]
    high = [15.0, -4.0, 4.5, 1.9, 4.5, 1.6, 0.0, nan, nan]
    bike = [6.0, 8.0, 0.6, 1.9, 4.5, 1.6, math.radians(30), nan, nan]
    expected = torch.tensor([car, bus, high, bike])
    torch.testing.assert_close(sample["boxes"], expected, rtol=0, atol=1e-4, equal_nan=True)
    names = [ATTRIBUTES[i] if i >= 0 else None for i in sample["attributes"]]
    assert names == ["vehicle.moving", None, None, "cycle.without_rider"]
    # the rack (no points, not a detection class) is the sample's ignore region
    rack = torch.tensor([[5.0, 8.0, 0.5, 1.0, 4.0, 1.0, 0.0]])
    torch.testing.assert_close(sample["ignore_regions"], rack, rtol=0, atol=1e-4)
    first = NuScenesSurround(root, height=30, width=80)[0]  # forward difference at the scene start
    torch.testing.assert_close(first["boxes"][0, 7:], torch.tensor([2.0, 0.0]), rtol=0, atol=1e-4)
    assert first["ignore_regions"].shape == (0, 7)


def _edit(root, table: str, edit) -> None:
    path = root / "v1.0-mini" / f"{table}.json"
    records = {r["token"]: r for r in json.loads(path.read_text())}
    edit(records)
    path.write_text(json.dumps(list(records.values())))


def test_ego_frame_is_the_ego_pose_turned_about_z_alone(root):
    # The lidar's ego pose of s1 pitched by 0.1 rad and rolled by -0.05 rad (after its 90 degree yaw), 2 m up:
    # the ego frame keeps its yaw and translation only, so the car stays (11.5, 0.5) away in x-y, as the devkit
    # measures it (global x-y minus the ego translation), its z is 1 - 2, and its yaw 30 degrees.
    def tilt(poses):
        # the quaternion of z-y-x Euler angles (yaw, pitch, roll)
        cy, sy, cp, sp, cr, sr = (f(a / 2) for a in (math.pi / 2, 0.1, -0.05) for f in (math.cos, math.sin))
        q = [cr * cp * cy + sr * sp * sy, sr * cp * cy - cr * sp * sy, cr * sp * cy + sr * cp * sy,
             cr * cp * sy - sr * sp * cy]  # fmt: skip
        poses["ego-lidar-s1"].update(rotation=q, translation=[100, 201, 2.0])

    _edit(root, "ego_pose", tilt)
    sample = NuScenesSurround(root, height=30, width=80)[1]
    car = torch.tensor([11.5, 0.5, -1.0, 1.9, 4.5, 1.6, math.radians(30), 2.0, 0.0])
    torch.testing.assert_close(sample["boxes"][0], car, rtol=0, atol=1e-4)
    # cam2ego still places CAM_FRONT where its own (untilted) ego pose puts it: 1 m ahead, 2 m lower
    torch.testing.assert_close(sample["cam2ego"][0, :3, 3], torch.tensor([2.5, 0.0, -0.5]), rtol=0, atol=1e-5)


def test_previous_key_frame_is_expressed_from_the_current_ego_frame(root):
    sample = NuScenesSurround(root, height=30, width=80, temporal=True)[1]
    # 0.5 s earlier the car stood 1 m further back in the current ego frame, and so did CAM_FRONT: same pixel
    now = _project(sample["lidar2img"][0], (11.5, 0.5, 1.0))
    torch.testing.assert_close(_project(sample["prev_lidar2img"][0], (10.5, 0.5, 1.0)), now, rtol=1e-5, atol=1e-4)
    assert sample["prev_images"].shape == sample["images"].shape


def test_missing_table_names_the_file(root):
    (root / "v1.0-mini" / "sample_annotation.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"nuScenes table missing: .*v1.0-mini/sample_annotation.json"):
        NuScenesSurround(root)


def test_missing_field_names_the_file_and_field(root):
    path = root / "v1.0-mini" / "sample_annotation.json"
    records = json.loads(path.read_text())
    del records[2]["num_radar_pts"]
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=r"sample_annotation.json: record car2 lacks field\(s\) \['num_radar_pts'\]"):
        NuScenesSurround(root)


def test_corrupt_table_names_its_file(root):
    path = root / "v1.0-mini" / "instance.json"
    path.write_text(path.read_text()[:-20])  # cut short, as by an interrupted copy
    with pytest.raises(ValueError, match=r"v1.0-mini/instance.json: not valid JSON \(.*line 1 column"):
        NuScenesSurround(root)


@pytest.mark.parametrize(
    "table, token, field, value, target",
    [
        ("sample_annotation", "car1", "instance_token", "inst-gone", "instance"),
        ("sample_annotation", "bus1", "attribute_tokens", ["attr-gone"], "attribute"),
        ("sample_annotation", "car2", "prev", "car-gone", "sample_annotation"),
        ("sample_data", "sd-s2-CAM_BACK", "ego_pose_token", "ego-gone", "ego_pose"),
        ("sample", "s1", "scene_token", "scene-gone", "scene"),
    ],
)
def test_a_token_pointing_at_no_record_names_the_table_record_and_token(root, table, token, field, value, target):
    _edit(root, table, lambda records: records[token].update({field: value}))
    missing = value[0] if isinstance(value, list) else value
    with pytest.raises(
        ValueError, match=rf"{table}.json: record {token} has {field} {missing}, which is not in .*/{target}.json"
    ):
        NuScenesSurround(root)


def test_attributes_the_devkit_refuses_raise_naming_the_annotation(root):
    _edit(root, "sample_annotation", lambda r: r["bus1"].update(attribute_tokens=["attr-vehicle.moving"] * 2))
    with pytest.raises(ValueError, match=r"sample_annotation.json: annotation bus1 has 2 attributes .* at most one"):
        NuScenesSurround(root)[1]
    _edit(root, "sample_annotation", lambda r: r["bus1"].update(attribute_tokens=["attr-vehicle.moving"]))
    _edit(root, "attribute", lambda r: r["attr-vehicle.moving"].update(name="vehicle.flying"))
    with pytest.raises(ValueError, match=r"attribute.json: attribute attr-vehicle.moving is 'vehicle.flying', not one"):
        NuScenesSurround(root)[1]


def test_nan_box_names_the_sample_and_field(root):
    path = root / "v1.0-mini" / "sample_annotation.json"
    records = json.loads(path.read_text())
    records[1]["translation"][2] = float("nan")
    path.write_text(json.dumps(records))
    with pytest.raises(
        ValueError, match=r"sample_annotation.json: annotation car1 \(sample s1\) has a non-finite translation"
    ):
        NuScenesSurround(root)[1]


def test_image_size_or_camera_count_that_does_not_match_the_calibration_raises(root):
    Image.new("RGB", (100, 50)).save(root / "samples" / "CAM_BACK" / "s1.jpg")
    with pytest.raises(ValueError, match=r"CAM_BACK/s1.jpg: image is 50x100 \(HxW\) but sample_data calibrates 90x160"):
        NuScenesSurround(root)[1]
    with pytest.raises(ValueError, match=r"sample s0 has no CAM_ROOF key frame"):
        NuScenesSurround(root, cameras=["CAM_FRONT", "CAM_ROOF"])[0]


def test_datamodule_batches_and_split_errors(root):
    data = NuScenes(
        str(root), height=30, width=80, batch_size=3, train_scenes=["scene-0001"], val_scenes=["scene-0001"]
    )
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    assert batch["images"].shape == (3, 6, 3, 30, 80) and [len(b) for b in batch["boxes"]] == [1, 4, 1]
    assert [len(a) for a in batch["attributes"]] == [1, 4, 1] and [len(r) for r in batch["ignore_regions"]] == [0, 1, 0]
    with pytest.raises(ValueError, match=r"needs train_scenes and val_scenes"):
        NuScenes(str(root), version="v1.0-trainval")
    with pytest.raises(ValueError, match=r"scene.json: no scene\(s\) \['scene-0061'"):
        NuScenes(str(root)).setup("fit")  # v1.0-mini's default split names scenes this folder lacks
