"""NuScenesDetection: hand-computed cases, two ranks against one, and the official devkit on random boxes."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from lightning_spatial.metrics import NuScenesDetection
from tests.spmd import run_spmd

CLASSES = ("car", "truck", "bus", "trailer", "construction_vehicle", "pedestrian", "motorcycle", "bicycle",
           "traffic_cone", "barrier")  # fmt: skip
ERRORS = ("ATE", "ASE", "AOE", "AVE", "AAE")


def box(x=10.0, y=0.0, w=2.0, l=4.0, h=1.5, yaw=0.0, vx=0.0, vy=0.0):  # noqa: E741
    return [x, y, 1.0, w, l, h, yaw, vx, vy]


def sample(preds, gts, dtype=torch.float64):
    """preds: (box, score, label[, attribute]); gts: (box, label[, attribute])."""
    pred = {"boxes": torch.tensor([p[0] for p in preds], dtype=dtype).reshape(-1, 9),
            "scores": torch.tensor([p[1] for p in preds], dtype=dtype),
            "labels": torch.tensor([p[2] for p in preds], dtype=torch.long)}  # fmt: skip
    gt = {"boxes": torch.tensor([g[0] for g in gts], dtype=dtype).reshape(-1, 9),
          "labels": torch.tensor([g[1] for g in gts], dtype=torch.long)}  # fmt: skip
    if any(len(p) > 3 for p in preds):
        pred["attributes"] = torch.tensor([p[3] for p in preds])
    if any(len(g) > 2 for g in gts):
        gt["attributes"] = torch.tensor([g[2] for g in gts])
    return pred, gt


def evaluate(samples, **kwargs):
    metric = NuScenesDetection(**kwargs)
    for pred, gt in samples:
        metric.update([pred], [gt])
    return {key: value.item() for key, value in metric.compute().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_perfect_car_alone(dtype):
    # AP 1 and errors 0 for the car; the nine classes without ground truth get AP 0 and errors 1, except the
    # errors the devkit leaves out (cone: orientation, velocity, attribute; barrier: velocity, attribute).
    car = box(10.0, 5.0, 2.0, 4.0, 1.5, 0.3, 1.0, 2.0)
    r = evaluate([sample([(car, 0.9, 0)], [(car, 0)], dtype)])
    assert (r["ATE/car"], r["ASE/car"], r["AOE/car"], r["AVE/car"]) == (0, 0, 0, 0)
    assert r["AP/car"] == pytest.approx(1, abs=1e-15)  # mean of 90 bins of (1 - 0.1), over 0.9
    assert r["AAE/car"] == 1  # no attributes: every accuracy is undefined and the devkit sets the error to 1
    assert math.isnan(r["AOE/traffic_cone"]) and math.isnan(r["AVE/barrier"]) and r["AOE/barrier"] == 1
    assert r["mAP"] == pytest.approx(0.1, abs=1e-15)
    expected = {"mATE": 0.9, "mASE": 0.9, "mAOE": 8 / 9, "mAVE": 7 / 8, "mAAE": 1.0}
    assert {k: r[k] for k in expected} == pytest.approx(expected, abs=1e-15)
    assert r["NDS"] == pytest.approx((5 * 0.1 + 0.1 + 0.1 + 1 / 9 + 1 / 8 + 0) / 10, abs=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("dx", "dy", "ap"), [(0.75, 0.0, 3 / 4), (0.0, -1.0, 2 / 4), (2.5, 0.0, 1 / 4)])
def test_offset_box_matches_from_its_distance_up(dtype, dx, dy, ap):
    # Thresholds 0.5, 1, 2, 4 m, strict: 0.75 m matches at three of them, exactly 1 m at two, 2.5 m at one.
    r = evaluate([sample([(box(10 + dx, dy), 0.5, 0)], [(box(), 0)], dtype)], classes=("car",))
    assert r["AP/car"] == pytest.approx(ap, abs=1e-15) and r["mAP"] == r["AP/car"]
    assert r["ATE/car"] == (1.0 if dx == 2.5 else math.hypot(dx, dy))  # the TP errors use the 2 m matches


def test_precision_recall_curve_by_hand():
    # Two cars; by score: a false positive, a hit 0.25 m off, a hit 0.375 m off. Precision 0, 1/2, 2/3 at
    # recall 0, 1/2, 1 -> p(r) = r up to 1/2, then 1/2 + (r - 1/2) / 3. AP = mean over r = 0.11 .. 1.00 of
    # max(p - 0.1, 0) / 0.9 = (sum_{j=1..40} j/100 + sum_{j=1..50} (0.4 + j/300)) / 90 / 0.9 = 32.45 / 81.
    preds = [(box(30.0), 0.9, 0), (box(10.25), 0.8, 0), (box(0.375, 20.0), 0.7, 0)]
    r = evaluate([sample(preds, [(box(), 0), (box(0.0, 20.0), 0)])], classes=("car",))
    assert r["AP/car"] == pytest.approx(32.45 / 81, abs=1e-14)
    # Score along recall 0.9 - 0.2 r; running mean of the translation errors 0.25, 0.3125 at scores 0.8, 0.7:
    # 0.25 up to r = 1/2, then 0.25 + (r - 1/2) / 8. Mean over r = 0.11 .. 1.00: (10 + 12.5 + 1.59375) / 90.
    assert r["ATE/car"] == pytest.approx(24.09375 / 90, abs=1e-14)


def test_errors_by_hand():
    # One exact-centre match per class: car sizes (2, 4, 1.5) vs (1, 4, 3): intersection 6, union 12 + 12 - 6
    # -> ASE 2/3; yaw 0.1 vs 0.1 + 2 pi - 0.3 -> 0.3; velocity (1, 2) vs (4, 6) -> 5; attribute 3 vs 3 -> 0.
    # Barrier: yaw 0 vs pi + 0.2 -> 0.2 (period pi); a car with those yaws: pi - 0.2.
    car_gt, car_pred = (
        box(w=2, l=4, h=1.5, yaw=0.1, vx=1, vy=2),
        box(w=1, l=4, h=3, yaw=0.1 + 2 * math.pi - 0.3, vx=4, vy=6),
    )
    barrier_gt, barrier_pred = box(y=5.0, yaw=0.0), box(y=5.0, yaw=math.pi + 0.2)
    car2_gt, car2_pred = box(y=-5.0, yaw=0.0), box(y=-5.0, yaw=math.pi + 0.2)
    preds = [(car_pred, 0.9, 0, 3), (barrier_pred, 0.8, 1, 0)]
    r = evaluate([sample(preds, [(car_gt, 0, 3), (barrier_gt, 1, -1)])], classes=("car", "barrier"))
    assert r["ASE/car"] == pytest.approx(2 / 3, abs=1e-15)
    assert r["AOE/car"] == pytest.approx(0.3, abs=1e-14)
    assert (r["AVE/car"], r["AAE/car"], r["ATE/car"]) == (5.0, 0.0, 0.0)
    assert r["AOE/barrier"] == pytest.approx(0.2, abs=1e-14)
    assert math.isnan(r["AVE/barrier"]) and math.isnan(r["AAE/barrier"])
    # Means over both classes, except the barrier's undefined errors; NDS caps the velocity error at 1.
    means = {"mAP": 1.0, "mATE": 0.0, "mASE": 1 / 3, "mAOE": 0.25, "mAVE": 5.0, "mAAE": 0.0}
    assert {k: r[k] for k in means} == pytest.approx(means, abs=1e-14)
    assert r["NDS"] == pytest.approx((5 * 1.0 + 1 + 2 / 3 + 0.75 + 0 + 1) / 10, abs=1e-14)
    r = evaluate([sample([(car2_pred, 0.9, 0, 1)], [(car2_gt, 0, 2)])], classes=("car",))
    assert r["AOE/car"] == pytest.approx(math.pi - 0.2, abs=1e-14)
    assert r["AAE/car"] == 1.0


def test_equal_scores_take_the_later_box_first():
    # The devkit sorts (score, index) ascending and reverses: of two equal scores the later box matches.
    preds = [(box(10.25), 0.5, 0), (box(10.125), 0.5, 0)]
    assert evaluate([sample(preds, [(box(), 0)])], classes=("car",))["ATE/car"] == 0.125


def test_a_ground_truth_matches_once():
    # Three cars; by score: a hit on the first, a second hit on it (false positive), a hit on the second.
    # Precision 1, 1/2, 2/3 at recall 1/3, 1/3, 2/3 -> p(r) = 1 below 1/3, 1/2 + (r - 1/3) / 2 up to 2/3, then 0.
    # AP = (23 * 0.9 + sum_{k=34..66} (0.4 + (k/100 - 1/3) / 2)) / 90 / 0.9 = (20.7 + 13.2 + 2.75) / 81.
    preds = [(box(), 0.9, 0), (box(10.25), 0.8, 0), (box(0.0, 20.0), 0.7, 0)]
    r = evaluate([sample(preds, [(box(), 0), (box(0.0, 20.0), 0), (box(0.0, -20.0), 0)])], classes=("car",))
    assert r["AP/car"] == pytest.approx(36.65 / 81, abs=1e-14)


@pytest.mark.parametrize(("first", "second", "ase"), [(10.75, 10.25, 0.5), (10.25, 9.75, 0.0)])
def test_nearest_ground_truth_then_the_earlier(first, second, ase):
    # The prediction (size 2, 4, 1.5) takes the nearer car; at equal distance the earlier one. Their sizes
    # tell which: (2, 4, 1.5) -> ASE 0; (1, 4, 1.5) -> 1 - 6/12.
    gts = [(box(first, w=2.0), 0), (box(second, w=1.0), 0)]
    assert evaluate([sample([(box(w=2.0), 0.9, 0)], gts)], classes=("car",))["ASE/car"] == ase


def test_matching_stays_within_a_sample():
    # A prediction on the spot of another sample's ground truth is a false positive.
    r = evaluate([sample([], [(box(), 0)]), sample([(box(), 0.9, 0)], [])], classes=("car",))
    assert r["AP/car"] == 0.0


def test_class_range():
    # Car range 50 m (strict) and pedestrian 40 m, for ground truth and predictions alike.
    car, pedestrian = box(30.0, 40.0), box(0.0, -45.0)
    s = sample([(car, 0.9, 0), (pedestrian, 0.9, 5)], [(car, 0), (pedestrian, 5)])
    assert (evaluate([s])["AP/car"], evaluate([s])["AP/pedestrian"]) == (0.0, 0.0)
    unfiltered = evaluate([s], class_range=None)
    assert (unfiltered["AP/car"], unfiltered["AP/pedestrian"]) == pytest.approx((1.0, 1.0), abs=1e-15)
    near = sample([(box(29.0, 40.0), 0.9, 0)], [(box(29.0, 40.0), 0)])
    assert evaluate([near])["AP/car"] == pytest.approx(1.0, abs=1e-15)


def test_ignore_regions_drop_bicycles_and_motorcycles_inside_them():
    # A 4 m x 2 m x 2 m rack turned by 90 degrees (its length along y) in sample A. Inside it (bounds included
    # in the devkit's points_in_box): a bicycle 1.9 m along and 0.9 m across, a motorcycle, a car (kept: not a
    # cycle); outside: a bicycle 3 m across, one above the rack. Dropped on both sides: the ground truth inside
    # and a confident stray prediction inside. Sample B has no rack: its bicycle prediction there is a false
    # positive. What remains is the precision-recall curve of test_precision_recall_curve_by_hand.
    rack = [10.0, 0.0, 1.0, 2.0, 4.0, 2.0, math.pi / 2]
    bike_in, bike_out, bike_high = box(10.9, 1.9), box(13.0, 0.0), [10.0, 1.0, 2.5, 2.0, 4.0, 1.5, 0.0, 0.0, 0.0]
    moto_in, car_in = box(9.5, -1.5), box(10.0, 0.0)
    gts = [(bike_in, 7), (bike_out, 7), (bike_high, 7), (moto_in, 6), (car_in, 0)]
    preds = [(box(10.5, 1.0), 0.99, 7), (bike_out, 0.8, 7), (bike_high, 0.7, 7), (moto_in, 0.9, 6), (car_in, 0.9, 0)]
    a, b = sample(preds, gts), sample([(bike_in, 0.95, 7)], [])
    a[1]["ignore_regions"] = torch.tensor([rack])
    r = evaluate([a, b])
    assert r["AP/bicycle"] == pytest.approx(32.45 / 81, abs=1e-14) and r["ATE/bicycle"] == 0.0
    assert (r["AP/motorcycle"], r["AP/car"]) == (0.0, pytest.approx(1.0, abs=1e-15))
    kept = evaluate([a, b], ignore_classes=())
    assert kept["AP/motorcycle"] == pytest.approx(1.0, abs=1e-15) and kept["AP/bicycle"] != r["AP/bicycle"]
    a[1]["ignore_regions"] = torch.tensor([rack[:6] + [0.0]])  # not turned: the bicycle at 0.9 m along is outside
    assert evaluate([a, b])["AP/bicycle"] != r["AP/bicycle"]


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric NuScenesDetection was called before")
@pytest.mark.parametrize("case", ["no updates", "no predictions", "no ground truth"])
def test_empty(case):
    car = (box(), 0.9, 0)
    samples = {"no updates": [], "no predictions": [sample([], [(box(), 0)])], "no ground truth": [sample([car], [])]}
    r = evaluate(samples[case])
    assert (r["mAP"], r["NDS"], r["mATE"], r["mAAE"]) == (0.0, 0.0, 1.0, 1.0)


def test_bad_input():
    metric = NuScenesDetection()
    pred, gt = sample([(box(), 0.9, 0)], [(box(), 0)])
    with pytest.raises(ValueError, match="one dict per sample"):
        metric.update([pred], [])
    with pytest.raises(ValueError, match=r"must be float \(n, 9\)"):
        metric.update([{**pred, "boxes": pred["boxes"][:, :7]}], [gt])
    with pytest.raises(ValueError, match=r"'scores'\] must have shape \(1,\)"):
        metric.update([{**pred, "scores": torch.ones(2)}], [gt])
    with pytest.raises(ValueError, match=r"target\[0\]\['ignore_regions'\] must be float \(k, 7\).* \(2, 9\)"):
        metric.update([pred], [{**gt, "ignore_regions": torch.zeros(2, 9)}])
    with pytest.raises(ValueError, match="class_range has no range for"):
        NuScenesDetection(classes=("car", "tram"))
    metric.update([{**pred, "labels": torch.tensor([10])}], [gt])
    with pytest.raises(ValueError, match="label 10.0 is not an index into 10 classes"):
        metric.compute()


def random_samples(n, seed, dtype=torch.float64, regions=False):
    """Ground truth in clusters (neighbours within matching distance), within and beyond the class ranges;
    noisy detections of most of it, some twice, some with a wrong label or attribute; stray detections;
    scores on a coarse grid (ties); some ground truth without attribute or velocity; with ``regions``, up to
    three ignore regions around the clusters."""
    g = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        m = int(g.integers(0, 15))
        xy = g.uniform(-45, 45, (3, 2))[g.integers(0, 3, m)] + g.normal(0, 2.5, (m, 2))
        gt_boxes = np.concatenate(
            [xy, g.uniform(-1, 1, (m, 1)), g.uniform(0.3, 5, (m, 3)), g.uniform(-4, 4, (m, 3))], 1
        )
        gt_boxes[g.random(m) < 0.1, 7:] = np.nan
        gt_labels = g.choice([0, 1, 3, 4, 5, 6, 7, 8, 9], m)  # no bus
        gt_attributes = g.integers(-1, 8, m)
        seen = np.concatenate([np.flatnonzero(g.random(m) < 0.7), np.flatnonzero(g.random(m) < 0.2)])
        k, stray = len(seen), int(g.integers(0, 6))
        boxes = gt_boxes[seen] + np.concatenate([g.normal(0, 0.6, (k, 3)), g.normal(0, 0.3, (k, 6))], 1)
        boxes = np.concatenate([boxes, g.uniform(-45, 45, (stray, 9))])
        boxes[:, 3:6] = np.abs(boxes[:, 3:6]) + 0.1
        boxes[:, 7:] = np.nan_to_num(boxes[:, 7:], nan=0.5)
        labels = np.concatenate([np.where(g.random(k) < 0.85, gt_labels[seen], g.integers(0, 10, k)),
                                 g.integers(0, 10, stray)])  # fmt: skip
        labels[labels == 3] = 4  # no trailer predictions
        attributes = np.concatenate([np.where(g.random(k) < 0.5, gt_attributes[seen], g.integers(0, 8, k)),
                                     g.integers(0, 8, stray)])  # fmt: skip
        pred = {"boxes": torch.tensor(boxes, dtype=dtype), "labels": torch.tensor(labels),
                "scores": torch.tensor(g.integers(1, 10, k + stray) / 10, dtype=dtype),
                "attributes": torch.tensor(attributes)}  # fmt: skip
        gt = {"boxes": torch.tensor(gt_boxes, dtype=dtype), "labels": torch.tensor(gt_labels),
              "attributes": torch.tensor(gt_attributes)}  # fmt: skip
        if regions:
            k = min(m, int(g.integers(0, 4)))  # around ground truth boxes, so that some lie inside
            region = [xy[:k], g.uniform(-1, 1, (k, 1)), g.uniform(1, 6, (k, 3)), g.uniform(-np.pi, np.pi, (k, 1))]
            gt["ignore_regions"] = torch.tensor(np.concatenate(region, 1), dtype=dtype)
        samples.append((pred, gt))
    return samples


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def _two_ranks(samples, split):
    import torch.distributed as dist

    rank = dist.get_rank()
    reference = evaluate(samples, sync_on_compute=False)
    metric = NuScenesDetection()
    mine = samples[:split] if rank == 0 else samples[split:]
    for i in range(0, len(mine), 3):  # several updates of up to three samples
        metric.update([p for p, _ in mine[i : i + 3]], [t for _, t in mine[i : i + 3]])
    result = {key: value.item() for key, value in metric.compute().items()}
    assert same(result, reference), {k: (result[k], reference[k]) for k in result if result[k] != reference[k]}


@pytest.mark.parametrize("split", [6, 5, 12], ids=["halves", "uneven", "rank1-idle"])
def test_two_ranks_give_the_single_process_result(split):
    samples = random_samples(12, seed=3, regions=True)
    assert not same(evaluate(samples), evaluate(samples, ignore_classes=()))  # the regions drop boxes
    run_spmd(_two_ranks, 2, samples, split)


# ---- against the official devkit ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def devkit():
    """The devkit's evaluation modules (bin/setup installs the devkit)."""
    try:
        from nuscenes.eval.common.config import config_factory
        from nuscenes.eval.common.data_classes import EvalBoxes
        from nuscenes.eval.detection import algo, data_classes
        from nuscenes.eval.detection.constants import ATTRIBUTE_NAMES, DETECTION_NAMES, TP_METRICS
    except ImportError as error:
        pytest.skip(f"needs the nuScenes devkit and its imports, as bin/setup installs them ({error})")
    return types.SimpleNamespace(algo=algo, data=data_classes, EvalBoxes=EvalBoxes,
                                 cfg=config_factory("detection_cvpr_2019"), attributes=ATTRIBUTE_NAMES,
                                 names=DETECTION_NAMES, tp=TP_METRICS)  # fmt: skip


def devkit_evaluate(dk, samples):
    """DetectionEval.evaluate on our samples: the devkit's distance filter line, accumulate/calc_ap/calc_tp
    with its cone and barrier rules, and DetectionMetrics for the means and NDS."""
    assert tuple(dk.names) == CLASSES
    gt_boxes, pred_boxes = dk.EvalBoxes(), dk.EvalBoxes()

    def detection_box(token, row, label, attribute, score=-1.0):
        x, y, z, w, l, h, yaw, vx, vy = (float(v) for v in row)  # noqa: E741
        rotation = (math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2))  # (w, x, y, z) about +z
        return dk.data.DetectionBox(token, (x, y, z), (w, l, h), rotation, (vx, vy), (x, y, z), -1, CLASSES[label],
                                    float(score), dk.attributes[attribute] if attribute >= 0 else "")  # fmt: skip

    for i, (pred, gt) in enumerate(samples):
        token = f"sample{i}"
        gts = [detection_box(token, *a) for a in zip(gt["boxes"], gt["labels"], gt["attributes"].tolist())]
        preds = [detection_box(token, *a) for a in zip(pred["boxes"], pred["labels"], pred["attributes"].tolist(),
                                                       pred["scores"])]  # fmt: skip
        for boxes, eval_boxes in ((gts, gt_boxes), (preds, pred_boxes)):
            eval_boxes.add_boxes(token, [b for b in boxes if b.ego_dist < dk.cfg.class_range[b.detection_name]])
    metrics = dk.data.DetectionMetrics(dk.cfg)
    for name in CLASSES:
        data = {
            th: dk.algo.accumulate(gt_boxes, pred_boxes, name, dk.cfg.dist_fcn_callable, th) for th in dk.cfg.dist_ths
        }
        for th in dk.cfg.dist_ths:
            metrics.add_label_ap(name, th, dk.algo.calc_ap(data[th], dk.cfg.min_recall, dk.cfg.min_precision))
        for metric in dk.tp:
            undefined = (name == "traffic_cone" and metric in ("attr_err", "vel_err", "orient_err")) or (
                name == "barrier" and metric in ("attr_err", "vel_err")
            )
            tp = np.nan if undefined else dk.algo.calc_tp(data[dk.cfg.dist_th_tp], dk.cfg.min_recall, metric)
            metrics.add_label_tp(name, metric, tp)
    out = {f"AP/{name}": ap for name, ap in metrics.mean_dist_aps.items()}
    out.update({f"{e}/{name}": metrics.get_label_tp(name, m) for e, m in zip(ERRORS, dk.tp) for name in CLASSES})
    out.update({f"m{e}": metrics.tp_errors[m] for e, m in zip(ERRORS, dk.tp)})
    return {**out, "mAP": metrics.mean_ap, "NDS": metrics.nd_score}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agrees_with_the_devkit(devkit, dtype):
    samples = random_samples(40, seed=0, dtype=dtype)
    ours, theirs = evaluate(samples), devkit_evaluate(devkit, samples)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], abs=1e-14, nan_ok=True), key
    # The random boxes cover what they should: matches in every class with both, none in the class without
    # ground truth (bus) or without predictions (trailer), right and wrong attributes.
    assert all(ours[f"AP/{name}"] > 0 for name in CLASSES if name not in ("bus", "trailer"))
    assert ours["AP/bus"] == ours["AP/trailer"] == 0 and 0 < ours["mAAE"] < 1
