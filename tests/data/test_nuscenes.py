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

from lightning_spatial.data import CAMERAS, CLASSES, NuScenes, NuScenesSurround

YAW90 = [math.cos(math.pi / 4), 0.0, 0.0, math.sin(math.pi / 4)]  # (w, x, y, z)
FRONT = [0.5, -0.5, 0.5, -0.5]  # camera x right, y down, z forward -> ego (x forward, y left, z up)
COLOURS = {name: (40 * i + 20, 200 - 30 * i, 90) for i, name in enumerate(CAMERAS)}


def _annotation(token, k, instance, ego_xyz, yaw_deg=120.0, lidar=10, radar=0, prev="", next=""):
    x, y, z = ego_xyz  # ego frame of key frame k: global = R(90 deg) @ (x, y) + (100, 200 + k)
    half = math.radians(yaw_deg) / 2
    return {"token": token, "sample_token": f"s{k}", "instance_token": instance, "visibility_token": "4",
            "attribute_tokens": [], "translation": [100 - y, 200 + k + x, z], "size": [1.9, 4.5, 1.6],
            "rotation": [math.cos(half), 0, 0, math.sin(half)], "prev": prev, "next": next,
            "num_lidar_pts": lidar, "num_radar_pts": radar}  # fmt: skip


def write_nuscenes(root, size=(90, 160)):
    tables = {name: [] for name in ("scene", "sample", "sample_data", "calibrated_sensor", "sensor", "ego_pose",
                                    "sample_annotation", "instance", "category", "log")}  # fmt: skip
    tables["scene"].append({"token": "sc0", "name": "scene-0001", "log_token": "log0", "nbr_samples": 3,
                            "first_sample_token": "s0", "last_sample_token": "s2", "description": ""})  # fmt: skip
    tables["log"].append({"token": "log0", "location": "test"})
    for k in range(3):
        tables["sample"].append({"token": f"s{k}", "timestamp": 500_000 * k, "scene_token": "sc0",
                                 "prev": f"s{k - 1}" if k else "", "next": f"s{k + 1}" if k < 2 else ""})  # fmt: skip
        tables["ego_pose"] += [
            {"token": f"ego-lidar-{k}", "timestamp": 500_000 * k, "translation": [100, 200 + k, 0], "rotation": YAW90},
            {"token": f"ego-cam-{k}", "timestamp": 500_000 * k, "translation": [100, 201 + k, 0], "rotation": YAW90},
        ]
    for channel in (*CAMERAS, "LIDAR_TOP"):
        camera = channel != "LIDAR_TOP"
        tables["sensor"].append({"token": f"sensor-{channel}", "channel": channel,
                                 "modality": "camera" if camera else "lidar"})  # fmt: skip
        tables["calibrated_sensor"].append(
            {"token": f"cs-{channel}", "sensor_token": f"sensor-{channel}",
             "translation": [1.5, 0.0, 1.5] if camera else [0.9, 0.0, 1.8],
             "rotation": FRONT if camera else [1, 0, 0, 0],
             "camera_intrinsic": [[100.0, 0.0, 80.0], [0.0, 100.0, 45.0], [0.0, 0.0, 1.0]] if camera else []}
        )  # fmt: skip
        for k in range(3):
            filename = f"samples/{channel}/s{k}.jpg" if camera else f"samples/LIDAR_TOP/s{k}.pcd.bin"
            tables["sample_data"].append(
                {"token": f"sd-{k}-{channel}", "sample_token": f"s{k}", "calibrated_sensor_token": f"cs-{channel}",
                 "ego_pose_token": f"ego-cam-{k}" if camera else f"ego-lidar-{k}", "timestamp": 500_000 * k,
                 "fileformat": "jpg" if camera else "pcd", "is_key_frame": True, "height": size[0] if camera else 0,
                 "width": size[1] if camera else 0, "filename": filename, "prev": "", "next": ""}
            )  # fmt: skip
            if camera:
                (root / "samples" / channel).mkdir(parents=True, exist_ok=True)
                Image.new("RGB", size[::-1], COLOURS[channel]).save(root / filename, quality=95)
    tables["sample_data"].append(dict(tables["sample_data"][0], token="sweep", is_key_frame=False,
                                      filename="sweeps/CAM_FRONT/missing.jpg"))  # fmt: skip
    for name in ("vehicle.car", "human.pedestrian.adult", "vehicle.bus.rigid", "animal"):
        tables["category"].append({"token": f"cat-{name}", "name": name, "description": ""})
        tables["instance"].append({"token": f"inst-{name}", "category_token": f"cat-{name}", "nbr_annotations": 1})
    car = "inst-vehicle.car"
    tables["sample_annotation"] += [
        _annotation("car0", 0, car, (11.5, 0.5, 1.0), next="car1"),
        _annotation("car1", 1, car, (11.5, 0.5, 1.0), prev="car0", next="car2"),
        _annotation("car2", 2, car, (11.5, 0.5, 1.0), prev="car1"),
        _annotation("far1", 1, car, (60.0, 0.0, 1.0)),  # beyond the 51.2 m range
        _annotation("ped1", 1, "inst-human.pedestrian.adult", (8.0, -3.0, 0.9), lidar=0),  # no lidar/radar points
        _annotation("bus1", 1, "inst-vehicle.bus.rigid", (-20.0, -5.0, 1.5), yaw_deg=90.0, lidar=0, radar=3),
        _annotation("dog1", 1, "inst-animal", (6.0, 2.0, 0.3)),  # not a detection class
    ]
    (root / "v1.0-mini").mkdir(parents=True)
    for name, records in tables.items():
        (root / "v1.0-mini" / f"{name}.json").write_text(json.dumps(records))
    return root


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


def test_boxes_classes_yaw_velocity_and_filters(root):
    sample = NuScenesSurround(root, height=30, width=80)[1]
    # kept: the car and the bus (radar points only); dropped: out of range, no points, an animal
    assert [CLASSES[i] for i in sample["labels"]] == ["car", "bus"]
    # car: global yaw 120 deg -> 30 deg in the ego frame (yaw 90); global velocity (0, 2) -> (2, 0) in ego
    car = [11.5, 0.5, 1.0, 1.9, 4.5, 1.6, math.radians(30), 2.0, 0.0]
    bus = [-20.0, -5.0, 1.5, 1.9, 4.5, 1.6, 0.0, 0.0, 0.0]  # a lone annotation: velocity 0
    torch.testing.assert_close(sample["boxes"], torch.tensor([car, bus]), rtol=0, atol=1e-4)
    first = NuScenesSurround(root, height=30, width=80)[0]  # forward difference at the scene start
    torch.testing.assert_close(first["boxes"][0, 7:], torch.tensor([2.0, 0.0]), rtol=0, atol=1e-4)


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
    assert batch["images"].shape == (3, 6, 3, 30, 80) and [len(b) for b in batch["boxes"]] == [1, 2, 1]
    with pytest.raises(ValueError, match=r"needs train_scenes and val_scenes"):
        NuScenes(str(root), version="v1.0-trainval")
    with pytest.raises(ValueError, match=r"scene.json: no scene\(s\) \['scene-0061'"):
        NuScenes(str(root)).setup("fit")  # v1.0-mini's default split names scenes this folder lacks
