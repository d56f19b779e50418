"""PETR's detection head over decoder-layer outputs: classification and box branches shared by all layers,
a Hungarian-matched set loss for every layer (auxiliary losses), and top-k decoding without NMS.

Box centres are predicted as offsets to each query's 3-D reference point in inverse-sigmoid space, then mapped
to metres over the point-cloud range, so the L1 loss and matching compare 10-d box codes in metres.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn

from . import boxes as box_code
from .denoise import Denoising
from .geometry import inverse_sigmoid
from .losses import l1_known, sigmoid_focal_loss


def _mlp(dims: int, out: int, norm: bool) -> nn.Sequential:
    layers = []
    for _ in range(2):
        layers += [nn.Linear(dims, dims), *([nn.LayerNorm(dims)] if norm else []), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(dims, out))


class QueryHead(nn.Module):
    def __init__(
        self,
        dims: int,
        num_classes: int,
        point_cloud_range: Sequence[float],
        max_detections: int = 300,
        cls_weight: float = 2.0,
        box_weight: float = 0.25,
    ):
        super().__init__()
        self.norm = nn.LayerNorm(dims)
        self.classify = _mlp(dims, num_classes, norm=True)
        self.regress = _mlp(dims, box_code.CODE_SIZE, norm=False)
        nn.init.constant_(self.classify[-1].bias, -4.595)  # prior probability 0.01, as in RetinaNet
        r = torch.tensor(point_cloud_range, dtype=torch.float32)
        self.register_buffer("low", r[:3], persistent=False)
        self.register_buffer("extent", r[3:] - r[:3], persistent=False)
        self.max_detections, self.cls_weight, self.box_weight = max_detections, cls_weight, box_weight

    def forward(self, hidden: torch.Tensor, reference: torch.Tensor, denoise: Denoising | None = None) -> dict:
        """hidden (L, B, Q, C) from every decoder layer, reference (B, Q, 3) in [0, 1] -> logits (L, B, Q, K)
        and box codes (L, B, Q, 10); the first queries' outputs go to "denoise" (logits, codes, ``denoise``)."""
        hidden = self.norm(hidden)
        delta = self.regress(hidden)
        centre = (delta[..., :3] + inverse_sigmoid(reference)).sigmoid() * self.extent + self.low
        logits, codes = self.classify(hidden), torch.cat([centre, delta[..., 3:]], -1)
        if denoise is None:
            return {"logits": logits, "codes": codes}
        p = denoise.labels.shape[1]
        return {
            "logits": logits[:, :, p:],
            "codes": codes[:, :, p:],
            "denoise": (logits[:, :, :p], codes[:, :, :p], denoise),
        }

    @torch.no_grad()
    def _cost(self, logits, codes, targets, labels, alpha: float = 0.25, gamma: float = 2.0):
        """(L, Q, m) focal classification cost + L1 cost on the codes without velocity (as PETR), every decoder
        layer of one sample at once."""
        p = logits.sigmoid()
        positive = -(p + 1e-8).log() * alpha * (1 - p) ** gamma
        negative = -(1 - p + 1e-8).log() * (1 - alpha) * p**gamma
        l1 = torch.cdist(codes[..., :8], targets[None, :, :8], p=1)
        return self.cls_weight * (positive - negative)[..., labels] + self.box_weight * l1

    def match(self, logits, codes, targets, labels) -> tuple[torch.Tensor, ...]:
        """Hungarian matching of every decoder layer and sample on the detached cost, with one device-to-host
        copy of all costs and one copy of all matches back (a copy per layer and sample waited for the GPU each
        time): logits (L, B, Q, K), codes (L, B, Q, 10) -> the batch index, query index, target code and target
        label of every matched pair, (L, P) each (codes (L, P, 10)): every layer matches min(Q, m) pairs of a
        sample of m boxes, so P is the same for all layers and one op computes a term for all of them."""
        layers, batch = logits.shape[:2]
        costs = [self._cost(logits[:, i].float(), codes[:, i].float(), targets[i], labels[i]) for i in range(batch)]
        host = torch.cat([c.flatten() for c in costs]).cpu().numpy()
        ends = np.cumsum([c.numel() for c in costs])
        per_sample = [c.reshape(cost.shape) for c, cost in zip(np.split(host, ends[:-1]), costs)]
        if not np.isfinite(host).all():  # the matching syncs anyway: the check costs no extra wait
            k, i = min((k, i) for i, c in enumerate(per_sample) for k in range(layers) if not np.isfinite(c[k]).all())
            bad = ~targets[i][:, :8].isfinite().all(-1)
            if bad.any():  # the data, not the training (the batch check on the host names it first)
                raise ValueError(
                    f"Hungarian matching of sample {i}: its box row {int(bad.nonzero()[0])} encodes to NaN or inf "
                    f"({targets[i][bad][0].tolist()}): only vx, vy may be NaN; repair or drop that box in the data"
                )
            raise FloatingPointError(
                f"Hungarian matching of sample {i} (decoder layer {k}): the predictions hold NaN or inf (logits "
                f"finite: {bool(logits[k, i].isfinite().all())}, box codes finite: "
                f"{bool(codes[k, i].isfinite().all())}), so training has diverged. Resume from an earlier "
                "checkpoint with a lower learning rate (model.lr), a tighter trainer.gradient_clip_val, or "
                "trainer.precision=32-true"
            )
        first = np.cumsum([0, *(len(lab) for lab in labels)])  # each sample's first row in the batch's targets
        pairs = [[linear_sum_assignment(cost[k]) for cost in per_sample] for k in range(layers)]
        index = np.stack(
            [
                np.concatenate([[np.full_like(q, i), q, t + first[i]] for i, (q, t) in enumerate(layer)], 1)
                for layer in pairs
            ]
        )  # (L, 3, P): batch index, query, row in the batch's targets
        batch_index, query, row = torch.as_tensor(index, device=logits.device).unbind(1)
        return batch_index, query, torch.cat(targets)[row], torch.cat(labels)[row]

    def loss(self, outputs, boxes, labels, normaliser=lambda count: count) -> dict[str, torch.Tensor]:
        """Summed over decoder layers, all layers' terms computed at once; each layer's terms are normalised by
        the batch's box count (``normaliser`` may average it over data replicas; at least 1). An empty scene trains
        the no-object class only: its box term is a graph-connected zero."""
        targets = [box_code.encode(b.float()) for b in boxes]
        logits, codes = outputs["logits"], outputs["codes"]
        count = torch.full((), float(sum(len(lab) for lab in labels)), dtype=logits.dtype, device=logits.device)
        num_boxes = normaliser(count).clamp(min=1)
        batch, query, matched_codes, matched_labels = self.match(logits, codes, targets, labels)
        layer = torch.arange(len(logits), device=logits.device)[:, None]  # (L, 1): broadcast against (L, P)
        classes = torch.zeros_like(logits).index_put_((layer, batch, query, matched_labels), logits.new_ones(()))
        cls = self.cls_weight * sigmoid_focal_loss(logits, classes, dim=(1, 2, 3)) / num_boxes  # (L,)
        weights = box_code.code_weights(codes)
        box = self.box_weight * l1_known(codes[layer, batch, query], matched_codes, weights, dim=(1, 2)) / num_boxes
        losses = {"loss": (cls + box).sum(), "loss_cls": cls[-1], "loss_box": box[-1]}
        if "denoise" in outputs:
            losses["loss_denoise"] = self.denoise_loss(*outputs["denoise"])
            losses["loss"] = losses["loss"] + losses["loss_denoise"]
        return losses

    def denoise_loss(self, logits, codes, denoise: Denoising) -> torch.Tensor:
        """The denoising queries' terms, summed over layers: focal loss normalised by the positive queries, L1
        towards each query's own box (positive or not, as StreamPETR) normalised by the real queries."""
        positive = denoise.labels >= 0
        classes = F.one_hot(denoise.labels.clamp(min=0), logits.shape[-1]).to(logits.dtype) * positive[..., None]
        real = denoise.real[..., None].to(codes.dtype)  # masks multiply: boolean indexing would wait for the GPU
        target = box_code.encode(denoise.boxes.float())  # padding's zero sizes encode finite (clamped)
        weights = box_code.code_weights(codes) * real
        # every layer at once: logits (L, B, D, K) against targets (B, D, K) broadcast over the layers
        cls = sigmoid_focal_loss(logits, classes.expand_as(logits), weight=real) / positive.sum().clamp(min=1)
        box = l1_known(codes, target, weights) / denoise.real.sum().clamp(min=1)
        return self.cls_weight * cls + self.box_weight * box

    @torch.no_grad()
    def decode(self, outputs) -> list[dict[str, torch.Tensor]]:
        """Top-k (query, class) pairs of the last layer by sigmoid score."""
        scores = outputs["logits"][-1].sigmoid()
        b, q, k = scores.shape
        top, index = scores.flatten(1).topk(min(self.max_detections, q * k))
        query = (index // k)[..., None].expand(-1, -1, box_code.CODE_SIZE)
        boxes = box_code.decode(outputs["codes"][-1].gather(1, query))
        return [{"boxes": boxes[i], "scores": top[i], "labels": index[i] % k} for i in range(b)]
