"""The nuScenes devkit's per-class detection algorithm (``nuscenes/eval/detection/algo.py``) over arrays.

Greedy centre-distance matching, the 101-point precision/recall curve, AP and the true-positive errors, as
``accumulate``, ``calc_ap`` and ``calc_tp`` define them. Float64 numpy on the host: the metric runs once per
epoch, and repeating the devkit's own ``np.interp`` calls makes the results agree with it to rounding.
"""

from __future__ import annotations

import numpy as np

THRESHOLDS = (0.5, 1.0, 2.0, 4.0)  # centre-distance match thresholds (m)
TP_THRESHOLD = 2.0  # the threshold whose matches give the TP errors
MIN_RECALL = 0.1
MIN_PRECISION = 0.1
RECALLS = np.linspace(0.0, 1.0, 101)
FIRST = round(100 * MIN_RECALL) + 1  # the devkit leaves out the bin at MIN_RECALL itself
NUM_ERRORS = 5  # translation, scale, orientation, velocity, attribute

# Columns of a box table row: x, y, z, w, l, h, yaw, vx, vy, label, attribute[, score].
XY, SIZE, YAW, VELOCITY, LABEL, ATTRIBUTE, SCORE = slice(0, 2), slice(3, 6), 6, slice(7, 9), 9, 10, 11


def evaluate_class(
    preds: np.ndarray, pred_sample: np.ndarray, gts: np.ndarray, gt_sample: np.ndarray, yaw_period: float
) -> tuple[list[float], np.ndarray]:
    """AP at each of ``THRESHOLDS`` and the five TP errors of one class.

    ``preds``/``gts`` are box table rows of this class in sample order, ``*_sample`` their (sorted) sample
    ids. As the devkit: no ground truth or no match gives AP 0 and errors 1.
    """
    # Descending score; equal scores: the later box first (the devkit reverses an ascending sort).
    order = np.lexsort((-np.arange(len(preds)), -preds[:, SCORE]))
    preds, pred_sample = preds[order], pred_sample[order]
    pair_pred, pair_gt = same_sample_pairs(pred_sample, gt_sample)
    dist = _norm(preds[pair_pred, XY] - gts[pair_gt, XY])
    aps, errors = [], np.ones(NUM_ERRORS)
    for threshold in THRESHOLDS:
        near = dist < threshold
        matched = greedy_match(pair_pred[near], pair_gt[near], dist[near], pred_sample, len(gts))
        is_tp = matched >= 0
        if not is_tp.any():  # also when the class has no ground truth
            aps.append(0.0)
            continue
        precision, confidence = _curves(is_tp, preds[:, SCORE], len(gts))
        aps.append(float(np.mean(np.maximum(precision[FIRST:] - MIN_PRECISION, 0.0))) / (1.0 - MIN_PRECISION))
        if threshold == TP_THRESHOLD:
            match_errors = box_errors(preds[is_tp], gts[matched[is_tp]], yaw_period)
            errors = _tp_errors(match_errors, preds[is_tp, SCORE], confidence)
    return aps, errors


def same_sample_pairs(pred_sample: np.ndarray, gt_sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (prediction, ground truth) index pair within one sample, by prediction then ground truth index."""
    start = np.searchsorted(gt_sample, pred_sample, "left")
    count = np.searchsorted(gt_sample, pred_sample, "right") - start
    pair_pred = np.repeat(np.arange(len(pred_sample)), count)
    pair_gt = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count - start, count)
    return pair_pred, pair_gt


def greedy_match(
    pair_pred: np.ndarray, pair_gt: np.ndarray, dist: np.ndarray, pred_sample: np.ndarray, num_gt: int
) -> np.ndarray:
    """The devkit's matching: predictions in index order each take the nearest ground truth of their sample
    that no earlier prediction took (the lowest index among equally near ones), among the candidate pairs
    (those within the threshold). Returns the matched ground truth per prediction, -1 for none.

    Samples do not interact, so step k matches the k-th candidate prediction of every sample at once.
    """
    matched = np.full(len(pred_sample), -1)
    taken = np.zeros(num_gt, dtype=bool)
    candidates = np.unique(pair_pred)
    step = _occurrence(pred_sample[candidates])[np.searchsorted(candidates, pair_pred)]
    order = np.lexsort((pair_gt, dist, pair_pred, step))
    pair_pred, pair_gt, step = pair_pred[order], pair_gt[order], step[order]
    bounds = np.searchsorted(step, np.arange(step.max(initial=-1) + 2))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        pred, gt = pair_pred[lo:hi], pair_gt[lo:hi]
        free = ~taken[gt]
        pred, first = np.unique(pred[free], return_index=True)  # first free pair = nearest free ground truth
        matched[pred] = gt[free][first]
        taken[matched[pred]] = True
    return matched


def box_errors(preds: np.ndarray, gts: np.ndarray, yaw_period: float) -> np.ndarray:
    """Per matched pair: centre distance, 1 - IoU of the aligned boxes, yaw difference, velocity error and
    attribute error (nan where the ground truth has no attribute, so the running mean skips it)."""
    inter = np.prod(np.minimum(preds[:, SIZE], gts[:, SIZE]), axis=1)
    iou = inter / (np.prod(preds[:, SIZE], axis=1) + np.prod(gts[:, SIZE], axis=1) - inter)
    half = yaw_period / 2
    yaw = np.abs((gts[:, YAW] - preds[:, YAW] + half) % yaw_period - half)
    attribute = np.where(gts[:, ATTRIBUTE] < 0, np.nan, (gts[:, ATTRIBUTE] != preds[:, ATTRIBUTE]).astype(float))
    velocity = _norm(preds[:, VELOCITY] - gts[:, VELOCITY])
    return np.stack([_norm(preds[:, XY] - gts[:, XY]), 1 - iou, yaw, velocity, attribute], axis=1)


def _curves(is_tp: np.ndarray, score: np.ndarray, num_gt: int) -> tuple[np.ndarray, np.ndarray]:
    """Precision and score at the 101 recall points (zero beyond the highest recall reached)."""
    tp = np.cumsum(is_tp).astype(float)
    fp = np.cumsum(~is_tp).astype(float)
    recall = tp / float(num_gt)
    return np.interp(RECALLS, recall, tp / (fp + tp), right=0), np.interp(RECALLS, recall, score, right=0)


def _tp_errors(errors: np.ndarray, match_score: np.ndarray, confidence: np.ndarray) -> np.ndarray:
    """``calc_tp`` of each error: its running mean over the matches, read at each recall point's score and
    averaged from the first bin above MIN_RECALL to the highest recall reached (1 if that is below it)."""
    reached = np.flatnonzero(confidence)
    last = reached[-1] if len(reached) else 0
    if last < FIRST:
        return np.ones(errors.shape[1])
    curves = [np.interp(confidence[::-1], match_score[::-1], _cummean(e)[::-1])[::-1] for e in errors.T]
    return np.array([np.mean(curve[FIRST : last + 1]) for curve in curves])


def _cummean(x: np.ndarray) -> np.ndarray:
    """Running mean ignoring nan (0 before the first number); all nan gives ones, as the devkit."""
    isnan = np.isnan(x)
    if isnan.all():
        return np.ones(len(x))
    total, count = np.nancumsum(x), np.cumsum(~isnan)
    return np.divide(total, count, out=np.zeros_like(total), where=count != 0)


def _occurrence(groups: np.ndarray) -> np.ndarray:
    """How many earlier elements share each element's group."""
    order = np.argsort(groups, kind="stable")
    ranked = groups[order]
    occurrence = np.empty(len(groups), dtype=np.int64)
    occurrence[order] = np.arange(len(groups)) - np.searchsorted(ranked, ranked, "left")
    return occurrence


def _norm(xy: np.ndarray) -> np.ndarray:
    return np.sqrt(xy[:, 0] * xy[:, 0] + xy[:, 1] * xy[:, 1])
