"""The nuScenes detection metric (mAP, TP errors, NDS) as a torchmetrics ``Metric``; see docs/metrics.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from ..data.batch import CLASSES
from ._algo import ATTRIBUTE, LABEL, NUM_ERRORS, SCORE, SIZE, XY, evaluate_class, same_sample_pairs

DETECTION_CLASSES = CLASSES  # the devkit's ten detection classes, in its order (labels index them)
# The devkit's detection_cvpr_2019 config: boxes this far (m, x-y distance from the ego origin) or farther are dropped.
CLASS_RANGE = MappingProxyType(dict(zip(DETECTION_CLASSES, (50, 50, 50, 50, 50, 40, 40, 40, 30, 30))))
ERRORS = ("ATE", "ASE", "AOE", "AVE", "AAE")
# Errors the devkit leaves out (nan) for a class: cones have no heading, velocity or attribute; barriers
# no velocity or attribute (and a heading only up to pi).
UNDEFINED = {"traffic_cone": ("AOE", "AVE", "AAE"), "barrier": ("AVE", "AAE")}
MAP_WEIGHT = 5
BIKE_RACK_CLASSES = ("bicycle", "motorcycle")  # the classes the devkit drops inside bike racks
REGION_WIDTH = 7  # an ignore region: x, y, z, w, l, h, yaw


class NuScenesDetection(Metric):
    """nuScenes detection score, as the official devkit's ``DetectionEval`` computes it.

    ``update(preds, target)`` takes one dict per sample. ``preds``: ``boxes`` (n, 9) float32 or float64
    = x, y, z, w, l, h, yaw, vx, vy (ego frame; m, rad, m/s), ``scores`` (n,), ``labels`` (n,) int indexing
    ``classes``, optional ``attributes`` (n,) int. ``target``: ``boxes`` (m, 9), ``labels`` (m,), optional
    ``attributes`` (m,) and ``ignore_regions`` (k, 7) = x, y, z, w, l, h, yaw (the sample's bike racks).
    Attributes are any consistent integer ids (-1: none); a missing key means none. The ego frame must be
    gravity-aligned (the ego pose's translation and yaw) for x-y distances to be the devkit's.

    ``compute()`` returns float64 scalars: ``mAP``, ``NDS``, ``mATE``, ``mASE``, ``mAOE``, ``mAVE``, ``mAAE``,
    ``AP/<class>`` and per-class errors ``ATE/<class>`` ... ``AAE/<class>`` (nan where the devkit leaves
    them out: AOE, AVE, AAE of ``traffic_cone``; AVE, AAE of ``barrier``). A class without ground truth or
    without a match has AP 0 and errors 1, and counts in the means.

    Without ground-truth attributes every matched pair's attribute accuracy is undefined, and the devkit
    then sets the class's AAE to 1: ``mAAE`` is 1 and contributes 0 to NDS, so
    ``NDS = (5 mAP + (1 - mATE) + (1 - mASE) + (1 - mAOE) + (1 - mAVE)) / 10`` (each error capped at 1),
    at most 0.9.

    Args:
        classes: class names, indexed by ``labels``. Errors are left out by name (``traffic_cone``,
            ``barrier``), and a class named ``barrier`` measures yaw modulo pi.
        class_range: per class name, the x-y distance from the ego origin from which boxes (predictions and
            ground truth) are dropped, as the devkit does; ``None`` keeps every box.
        ignore_classes: class names whose boxes (predictions and ground truth) are dropped where their centre
            lies inside one of their sample's ``ignore_regions`` (bounds included), as the devkit drops
            bicycles and motorcycles in bike racks; names not in ``classes`` are ignored.
        kwargs: torchmetrics ``Metric`` arguments.

    The devkit's other filter, ground truth without lidar or radar points, is the data's job (it needs the
    point counts). The devkit refuses more than 500 predictions per sample; this metric takes any number.
    States are concatenated over the metric's ``process_group`` in sample order (rank by rank), so ranks
    holding disjoint samples give the single-process result.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(
        self,
        classes: Sequence[str] = DETECTION_CLASSES,
        class_range: Mapping[str, float] | None = CLASS_RANGE,
        ignore_classes: Sequence[str] = BIKE_RACK_CLASSES,
        **kwargs,
    ) -> None:
        kwargs.setdefault("dist_sync_fn", _gather_flat)
        super().__init__(**kwargs)
        self.classes = tuple(classes)
        if len(set(self.classes)) != len(self.classes) or not self.classes:
            raise ValueError(f"classes must be distinct names, got {self.classes}")
        missing = [name for name in self.classes if class_range is not None and name not in class_range]
        if missing:
            raise ValueError(f"class_range has no range for {missing}: give one for every class, or class_range=None")
        self.class_range = None if class_range is None else {name: float(class_range[name]) for name in self.classes}
        self.ignore_labels = [c for c, name in enumerate(self.classes) if name in ignore_classes]
        # Rows of box tables (see _algo's columns), of ignore regions and, per sample, its (predictions, ground
        # truths, regions) counts: concatenated in the same order, so the counts recover each row's sample.
        self.add_state("preds", default=[], dist_reduce_fx="cat")
        self.add_state("targets", default=[], dist_reduce_fx="cat")
        self.add_state("regions", default=[], dist_reduce_fx="cat")
        self.add_state("counts", default=[], dist_reduce_fx="cat")

    def update(self, preds: Sequence[Mapping[str, Tensor]], target: Sequence[Mapping[str, Tensor]]) -> None:
        if len(preds) != len(target):
            raise ValueError(f"preds and target must hold one dict per sample, got {len(preds)} and {len(target)}")
        counts = []
        for i, (pred, gt) in enumerate(zip(preds, target)):
            self.preds.append(_table(pred, f"preds[{i}]", scored=True).to(self.device))
            self.targets.append(_table(gt, f"target[{i}]", scored=False).to(self.device))
            self.regions.append(_regions(gt, f"target[{i}]").to(self.device))
            counts.append((len(self.preds[-1]), len(self.targets[-1]), len(self.regions[-1])))
        self.counts.append(torch.tensor(counts, dtype=torch.float64, device=self.device).reshape(-1, 3))

    def compute(self) -> dict[str, Tensor]:
        preds, pred_sample, targets, gt_sample = self._boxes()
        result, errors = {}, []
        for c, name in enumerate(self.classes):
            p, g = preds[:, LABEL] == c, targets[:, LABEL] == c
            period = np.pi if name == "barrier" else 2 * np.pi
            aps, class_errors = evaluate_class(preds[p], pred_sample[p], targets[g], gt_sample[g], period)
            class_errors[[ERRORS.index(e) for e in UNDEFINED.get(name, ())]] = np.nan
            result[f"AP/{name}"] = float(np.mean(aps))
            result.update({f"{e}/{name}": float(v) for e, v in zip(ERRORS, class_errors)})
            errors.append(class_errors)
        result["mAP"] = float(np.mean([result[f"AP/{name}"] for name in self.classes]))
        means = [_nanmean(column) for column in np.array(errors).T]
        result.update({f"m{e}": m for e, m in zip(ERRORS, means)})
        # max(0, nan) is 0, as in the devkit: an error that no class defines scores 0.
        scores = sum(max(0.0, 1.0 - m) for m in means)
        result["NDS"] = (MAP_WEIGHT * result["mAP"] + scores) / (MAP_WEIGHT + NUM_ERRORS)
        return {key: torch.tensor(value, dtype=torch.float64, device=self.device) for key, value in result.items()}

    def _boxes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Predictions and ground truth that the devkit's ``filter_eval_boxes`` keeps (in range, not ignored),
        each with its sample ids, checked as the devkit does."""
        counts = _rows(self.counts, 3).astype(np.int64)
        sample_ids = [np.repeat(np.arange(len(counts)), count) for count in counts.T]
        regions = _rows(self.regions, REGION_WIDTH)
        boxes = []
        for rows, sample, name in (
            (_rows(self.preds, SCORE + 1), sample_ids[0], "prediction"),
            (_rows(self.targets, ATTRIBUTE + 1), sample_ids[1], "ground truth"),
        ):
            self._check(rows, name)
            keep = self._in_range(rows) & ~self._ignored(rows, sample, regions, sample_ids[2])
            boxes += [rows[keep], sample[keep]]
        return tuple(boxes)

    def _check(self, rows: np.ndarray, name: str) -> None:
        """The devkit's input assertions, as errors naming the value."""
        labels = rows[:, LABEL]
        bad = (labels < 0) | (labels >= len(self.classes)) | (labels != np.round(labels))
        if bad.any():
            raise ValueError(f"{name} label {labels[bad][0]} is not an index into {len(self.classes)} classes")
        for what, values in (("x, y, z, w, l, h, yaw", rows[:, :7]), ("score", rows[:, SCORE:])):
            if np.isnan(values).any():
                raise ValueError(f"a {name} {what} is nan (only velocities may be)")
        if (rows[:, SIZE] <= 0).any():
            raise ValueError(f"{name} sizes must be positive, got {rows[:, SIZE][(rows[:, SIZE] <= 0).any(1)][0]}")

    def _in_range(self, rows: np.ndarray) -> np.ndarray:
        if self.class_range is None:
            return np.ones(len(rows), dtype=bool)
        limit = np.array([self.class_range[name] for name in self.classes])[rows[:, LABEL].astype(np.int64)]
        xy = rows[:, XY]
        return np.sqrt(xy[:, 0] * xy[:, 0] + xy[:, 1] * xy[:, 1]) < limit

    def _ignored(
        self, rows: np.ndarray, sample: np.ndarray, regions: np.ndarray, region_sample: np.ndarray
    ) -> np.ndarray:
        """Boxes of an ignore class whose centre lies inside a region of their sample, bounds included (the
        devkit's ``points_in_box`` on the bike racks)."""
        ignored = np.zeros(len(rows), dtype=bool)
        candidates = np.flatnonzero(np.isin(rows[:, LABEL], self.ignore_labels))
        pair_box, pair_region = same_sample_pairs(sample[candidates], region_sample)
        box, region = rows[candidates[pair_box]], regions[pair_region]
        offset = box[:, :3] - region[:, :3]
        cos, sin = np.cos(region[:, 6]), np.sin(region[:, 6])
        along = cos * offset[:, 0] + sin * offset[:, 1]  # the region's own x (its length l) and y (its width w)
        across = cos * offset[:, 1] - sin * offset[:, 0]
        half_w, half_l, half_h = (region[:, 3:6] / 2).T
        inside = (np.abs(along) <= half_l) & (np.abs(across) <= half_w) & (np.abs(offset[:, 2]) <= half_h)
        ignored[candidates[pair_box[inside]]] = True
        return ignored


def _table(sample: Mapping[str, Tensor], where: str, scored: bool) -> Tensor:
    """One sample's boxes as float64 rows: box, label, attribute (-1 if absent)[, score]."""
    needed = ("boxes", "labels", "scores") if scored else ("boxes", "labels")
    if any(key not in sample for key in needed):
        raise ValueError(f"{where} needs keys {needed}, got {tuple(sample)}")
    boxes = sample["boxes"]
    if boxes.ndim != 2 or boxes.shape[1] != 9 or not boxes.is_floating_point():
        raise ValueError(
            f"{where}['boxes'] must be float (n, 9): x, y, z, w, l, h, yaw, vx, vy; "
            f"got {boxes.dtype} {tuple(boxes.shape)}"
        )
    columns = {"labels": sample["labels"], "attributes": sample.get("attributes", torch.full((len(boxes),), -1))}
    if scored:
        columns["scores"] = sample["scores"]
    for key, value in columns.items():
        if value.shape != (len(boxes),):
            raise ValueError(f"{where}[{key!r}] must have shape ({len(boxes)},) as its boxes, got {tuple(value.shape)}")
    columns = [value.to(device=boxes.device, dtype=torch.float64)[:, None] for value in columns.values()]
    return torch.cat([boxes.to(torch.float64), *columns], dim=1)


def _regions(sample: Mapping[str, Tensor], where: str) -> Tensor:
    """One sample's ignore regions as float64 rows (none without the key)."""
    regions = sample.get("ignore_regions")
    if regions is None:
        return torch.zeros(0, REGION_WIDTH, dtype=torch.float64)
    if regions.ndim != 2 or regions.shape[1] != REGION_WIDTH or not regions.is_floating_point():
        raise ValueError(
            f"{where}['ignore_regions'] must be float (k, {REGION_WIDTH}): x, y, z, w, l, h, yaw; "
            f"got {regions.dtype} {tuple(regions.shape)}"
        )
    return regions.to(torch.float64)


def _rows(state: list[Tensor] | Tensor, width: int) -> np.ndarray:
    """A state as a host (rows, width) array: a list of tables before a sync, one flat tensor after."""
    parts = [state] if isinstance(state, Tensor) else state
    flat = [part.reshape(-1) for part in parts]
    return (torch.cat(flat) if flat else torch.zeros(0)).reshape(-1, width).to("cpu", torch.float64).numpy()


def _gather_flat(state: Tensor, group=None) -> list[Tensor]:
    """torchmetrics' gather, of the state flattened to float64: a rank without updates sends torchmetrics'
    1-D empty placeholder in the metric's dtype, which must meet the other ranks' float64 tables."""
    return gather_all_tensors(state.to(torch.float64).reshape(-1), group)


def _nanmean(values: np.ndarray) -> float:
    """The devkit's mean over classes, ignoring nan (nan if no class defines the error)."""
    return float(np.nanmean(values)) if not np.isnan(values).all() else float("nan")
