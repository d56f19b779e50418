"""The four BEV detectors on one CPU: geometry against a rig built in the test, head targets decoded back to
their boxes, a training step, overfitting one tiny batch, empty scenes, bad input, the Lightning loop."""

from __future__ import annotations

import gc
import itertools
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
import torchvision

from lightning_spatial import SpatialParallelStrategy
from lightning_spatial.models.bev import PETR, BEVFormer, LiftSplat, SimpleBEV
from lightning_spatial.models.bev import boxes as box_code
from lightning_spatial.models.bev.backbone import ImageEncoder
from lightning_spatial.models.bev.bev_encoder import ResNetBEVEncoder
from lightning_spatial.models.bev.center_head import CenterHead
from lightning_spatial.models.bev.denoise import denoising_queries
from lightning_spatial.models.bev.geometry import BEVGrid, frustum_to_ego, pixel_centres, project
from lightning_spatial.models.bev.losses import gaussian_focal_loss, sigmoid_focal_loss
from lightning_spatial.models.bev.query_head import QueryHead
from tests.models.surround import RANGE, random_boxes, rig, surround_batch

MODELS = {
    "petr": lambda: PETR.tiny(),
    "petrv2": lambda: PETR.tiny(temporal=True, feature_guided_pe=True),
    "lift_splat": lambda: LiftSplat.tiny(),
    "simple_bev": lambda: SimpleBEV.tiny(),
    "bevformer": lambda: BEVFormer.tiny(num_cameras=6),
    "bevformer_temporal": lambda: BEVFormer.tiny(num_cameras=6, temporal=True),
}
TEMPORAL = ("petrv2", "bevformer_temporal")


def _model_and_batch(name, **batch_kwargs):
    torch.manual_seed(0)
    return MODELS[name](), surround_batch(temporal=name in TEMPORAL, **batch_kwargs)


def _terms(losses):
    return [v for k, v in losses.items() if k != "loss"]  # (classification/heatmap, box/regression)


# --- geometry -------------------------------------------------------------------------------------------


def test_feature_cell_centres_in_image_pixels():
    # Two cells over 32 pixels cover pixels 0..15 and 16..31, centred at 7.5 and 23.5.
    assert pixel_centres(2, 32).tolist() == [7.5, 23.5]
    torch.testing.assert_close(pixel_centres(3, 88), torch.tensor([88 / 6 - 0.5, 43.5, 88 * 5 / 6 - 0.5]))


def test_frustum_points_lie_on_the_optical_axis():
    # 16 x 48 images, 1 x 3 features: cell (0, 1) is centred on the principal point (23.5, 7.5).
    _, cam2ego, lidar2img = rig(6, 16, 48)
    points = frustum_to_ego(lidar2img[None], torch.tensor([5.0, 10.0]), (1, 3), (16, 48))
    assert points.shape == (1, 6, 2, 1, 3, 3)
    for cam in range(6):
        centre, forward = cam2ego[cam, :3, 3], cam2ego[cam, :3, 2]
        for i, depth in enumerate([5.0, 10.0]):
            torch.testing.assert_close(points[0, cam, i, 0, 1], centre + depth * forward)


def test_projection_samples_the_cell_whose_frustum_made_the_point():
    """PETR (frustum -> ego) and Simple-BEV (ego -> grid_sample) agree on where each feature cell is."""
    _, _, lidar2img = rig(6, 32, 88)
    h, w = 2, 6
    points = frustum_to_ego(lidar2img[None], torch.tensor([7.0]), (h, w), (32, 88))  # (1, 6, 1, h, w, 3)
    features = torch.randn(6, 4, h, w)
    for cam in range(6):
        grid, valid = project(points[0, cam].reshape(-1, 3), lidar2img[None, cam : cam + 1], (32, 88))
        assert valid.eq(1).all()
        expected = torch.stack(
            torch.meshgrid((torch.arange(h) * 2 + 1) / h - 1, (torch.arange(w) * 2 + 1) / w - 1, indexing="ij")[::-1],
            -1,
        ).reshape(-1, 2)
        torch.testing.assert_close(grid[0, 0], expected, atol=1e-4, rtol=0)
        at = grid[0, 0][None, :, None]  # (1, h*w, 1, 2)
        sampled = torch.nn.functional.grid_sample(features[cam : cam + 1], at, align_corners=False)
        torch.testing.assert_close(sampled[0, :, :, 0], features[cam].reshape(4, -1), atol=1e-4, rtol=0)


def test_projection_rejects_points_behind_or_beside_the_camera():
    _, _, lidar2img = rig(6, 32, 88)
    points = torch.tensor([[10.0, 0.0, 1.5], [-10.0, 0.0, 1.5], [1.5, 30.0, 1.5]])  # ahead, behind, far left
    _, valid = project(points, lidar2img[None, :1], (32, 88))
    assert valid[0, 0].tolist() == [1.0, 0.0, 0.0]


def test_bev_grid_indexes_cells_x_major():
    grid = BEVGrid(RANGE, (32, 32))  # 3.2 m cells
    points = torch.tensor([[-51.2 + 3.2 * 2.5, -51.2 + 3.2 * 7.5, 0.0], [0.0, 0.0, 4.0], [60.0, 0.0, 0.0]])
    index, valid = grid.flat_index(points)
    assert index[0] == 2 * 32 + 7 and valid.tolist() == [1.0, 0.0, 0.0]
    assert (index >= 0).all() and (index < 32 * 32).all()


def test_box_code_round_trip():
    boxes = random_boxes(20, torch.Generator().manual_seed(1))
    code = box_code.encode(boxes)
    assert code.shape == (20, 10)
    torch.testing.assert_close(code[:, 3:6], boxes[:, 3:6].log())
    torch.testing.assert_close(box_code.decode(code), boxes)


def test_focal_losses():
    logits, targets = torch.randn(5, 7), (torch.rand(5, 7) > 0.7).float()
    expected = torchvision.ops.sigmoid_focal_loss(logits, targets, reduction="sum")
    torch.testing.assert_close(sigmoid_focal_loss(logits, targets), expected)
    # CenterNet: a peak at p = 0.5 costs -log(0.5) * 0.5^2; a negative at p = 0.5 on a 0.5 gaussian costs
    # -log(0.5) * 0.5^2 * (1 - 0.5)^4.
    loss = gaussian_focal_loss(torch.zeros(2), torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(loss, torch.tensor(math.log(2) * (0.25 + 0.25 / 16)))


def test_image_encoder_returns_one_level_at_the_stride():
    encoder = ImageEncoder("resnet18", 8, stride=8)
    out = encoder(torch.randn(2, 3, 32, 88))
    assert out.shape == (2, 8, 4, 11)
    out.square().sum().backward()
    assert all(lateral.weight.grad.abs().sum() > 0 for lateral in encoder.laterals)  # strides 8, 16 and 32 feed in
    with pytest.raises(
        ValueError, match=r"images of \(16, 88\) pixels are smaller than the backbone's coarsest stride 32"
    ):
        encoder(torch.randn(1, 3, 16, 88))
    with pytest.raises(ValueError, match=r"feature strides \[2, 4, 8, 16, 32\]; stride=12"):
        ImageEncoder("resnet18", 8, stride=12)


# --- heads ----------------------------------------------------------------------------------------------


def test_center_head_decodes_its_own_targets_to_the_boxes():
    head = CenterHead(8, 10, BEVGrid(RANGE, (32, 32)), channels=8)
    boxes = torch.tensor(
        [[-20.1, 5.3, 0.7, 1.9, 4.5, 1.6, 0.3, 1.0, -2.0], [12.7, -30.2, 1.1, 2.4, 9.0, 3.1, -2.8, 0.0, 0.5]]
    )
    outside = torch.tensor([[52.0, 0.0, 0.5, 2.0, 4.0, 1.5, 0.0, 0.0, 0.0]])  # just beyond the grid: left out
    heatmap, regression, mask = head.targets(torch.cat([boxes, outside]), torch.tensor([0, 7, 3]))
    assert mask.sum() == 2 and heatmap[3].eq(0).all()
    assert heatmap.flatten(1).amax(1).tolist() == [1.0, 0, 0, 0, 0, 0, 0, 1.0, 0, 0]
    logits = torch.logit(heatmap.clamp(1e-6, 1 - 1e-6))[None]
    (found,) = head.decode({"heatmap": logits, "regression": regression[None]})
    order = found["labels"][:2].argsort()
    torch.testing.assert_close(found["boxes"][:2][order], boxes, atol=1e-4, rtol=0)
    assert found["labels"][:2][order].tolist() == [0, 7]


def test_hungarian_matching_finds_the_permutation():
    head = QueryHead(16, 10, RANGE)
    targets = box_code.encode(random_boxes(4, torch.Generator().manual_seed(2)))
    labels = torch.tensor([1, 4, 4, 9])
    queries = torch.tensor([5, 0, 3, 6])  # query queries[j] predicts target j exactly
    codes = torch.randn(1, 8, 10) * 30
    codes[0, queries] = targets
    logits = torch.full((1, 8, 10), -5.0)
    logits[0, queries, labels] = 5.0
    layers = head.match(torch.stack([logits] * 2), torch.stack([codes] * 2), [targets], [labels])
    assert all(torch.equal(both[0], both[1]) for both in layers)  # (L, P): the same pairs in both layers
    batch, query, matched, matched_labels = (both[0] for both in layers)
    assert batch.tolist() == [0] * 4
    for q, code, label in zip(query, matched, matched_labels):
        j = queries.tolist().index(q)
        assert torch.equal(code, targets[j]) and label == labels[j]


def _match_alone(head, logits, codes, targets, labels, k: int, i: int) -> tuple[torch.Tensor, ...]:
    """Layer ``k`` of sample ``i`` matched on its own: its batch index (0), query index, target code and label."""
    one = head.match(logits[k : k + 1, i : i + 1], codes[k : k + 1, i : i + 1], targets[i : i + 1], labels[i : i + 1])
    return tuple(t[0] for t in one)


def test_matching_all_layers_and_samples_at_once_equals_matching_each_alone():
    """The matching copies every layer's and sample's cost in one go (one wait for the GPU): each pair's
    matches, an empty scene's none included, are the ones it gets matched alone."""
    head, g = QueryHead(16, 10, RANGE), torch.Generator().manual_seed(4)
    counts = [3, 0, 5]
    targets = [box_code.encode(random_boxes(n, g)) for n in counts]
    labels = [torch.randint(0, 10, (n,), generator=g) for n in counts]
    logits, codes = torch.randn(2, 3, 12, 10, generator=g), torch.randn(2, 3, 12, 10, generator=g) * 20
    for k, (batch, query, matched, matched_labels) in enumerate(zip(*head.match(logits, codes, targets, labels))):
        for i in range(3):
            _, alone, alone_codes, alone_labels = _match_alone(head, logits, codes, targets, labels, k, i)
            mine = batch == i
            assert torch.equal(query[mine], alone) and torch.equal(matched[mine], alone_codes)
            assert torch.equal(matched_labels[mine], alone_labels) and len(alone) == counts[i]


def test_the_set_loss_of_all_layers_at_once_equals_each_layers_detr_terms():
    """The loss computes every decoder layer's terms in one go; written here per layer and sample as DETR states
    them (torchvision's focal loss against the matched one-hot classes, weighted L1 on the matched codes, each
    over the batch's box count), an empty scene and a sample with more boxes than queries among them."""
    head, g = QueryHead(16, 10, RANGE), torch.Generator().manual_seed(6)
    boxes = [random_boxes(n, g) for n in (3, 0, 7)]
    labels = [torch.randint(0, 10, (len(b),), generator=g) for b in boxes]
    logits = torch.randn(3, 3, 6, 10, generator=g, dtype=torch.float64, requires_grad=True)
    codes = (torch.randn(3, 3, 6, 10, generator=g, dtype=torch.float64) * 20).requires_grad_()
    losses = head.loss({"logits": logits, "codes": codes}, boxes, labels)
    targets = [box_code.encode(b.float()) for b in boxes]
    weights = torch.tensor(box_code.CODE_WEIGHTS, dtype=torch.float64)
    terms = []
    for k in range(3):
        classes, box = torch.zeros(3, 6, 10, dtype=torch.float64), 0
        for i in range(3):
            _, query, matched, matched_labels = _match_alone(head, logits, codes, targets, labels, k, i)
            assert len(query) == min(6, len(boxes[i]))
            classes[i, query, matched_labels] = 1
            box = box + ((codes[k, i, query] - matched).abs() * weights).sum()
        cls = torchvision.ops.sigmoid_focal_loss(logits[k], classes, reduction="sum")
        terms.append((head.cls_weight * cls / 10, head.box_weight * box / 10))  # 10 boxes in the batch
    expected = sum(c + b for c, b in terms)
    torch.testing.assert_close(losses["loss"], expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(losses["loss_cls"], terms[-1][0], rtol=1e-12, atol=0)
    torch.testing.assert_close(losses["loss_box"], terms[-1][1], rtol=1e-12, atol=0)
    grads = torch.autograd.grad(losses["loss"], [logits, codes])
    for grad, want in zip(grads, torch.autograd.grad(expected, [logits, codes])):
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-15)


def test_diverged_predictions_fail_the_matching_with_a_way_out():
    """A NaN box code (bf16 training that diverged) reaches the matching: a clear error, not scipy's own."""
    head = QueryHead(16, 10, RANGE)
    targets = box_code.encode(random_boxes(3, torch.Generator().manual_seed(3)))
    codes, logits = torch.randn(2, 1, 8, 10), torch.randn(2, 1, 8, 10)
    codes[1, 0, 5, 2] = float("nan")
    with pytest.raises(
        FloatingPointError, match=r"sample 0 \(decoder layer 1\): .*codes finite: False.*lower learning"
    ):
        head.match(logits, codes, [targets], [torch.tensor([0, 1, 2])])


def _head_loss(head: str, boxes: list[torch.Tensor], outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = [torch.arange(len(b)) + 2 * i for i, b in enumerate(boxes)]
    if head == "query":
        return QueryHead(16, 10, RANGE).loss(outputs, boxes, labels)["loss"]
    if head == "center":
        return CenterHead(8, 10, BEVGrid(RANGE, (16, 16)), channels=8).loss(outputs, boxes, labels)["loss"]
    low, high = torch.tensor(RANGE[:3]), torch.tensor(RANGE[3:])
    torch.manual_seed(0)  # the same jitter every time
    dn = denoising_queries(boxes, labels, groups=2, num_queries=4, low=low, extent=high - low, split=0.75)
    return QueryHead(16, 10, RANGE).denoise_loss(outputs["logits"], outputs["codes"], dn)


@pytest.mark.parametrize("head", ["query", "denoise", "center"])
def test_an_unknown_velocity_adds_nothing_to_the_loss_or_its_gradients(head):
    """A box whose velocity is NaN (unknown, as nuScenes has it for a lone annotation) trains everything but its
    velocity. Reference without that term, from finite targets: its velocity terms c |p - v| (p: a predicted
    velocity, |p| < M) are c (M - p) at v = M, c (M + p) at v = -M and c (2M - p) at v = 2M, so the loss
    without them is (loss(M) + loss(-M)) / 2 - (loss(2M) - loss(M)), and its gradients (grad(M) + grad(-M)) / 2."""
    g = torch.Generator().manual_seed(7)
    boxes = [random_boxes(3, g), random_boxes(2, g)]
    shapes = {"query": {"logits": (2, 2, 6, 10), "codes": (2, 2, 6, 10)},
              "denoise": {"logits": (2, 2, 6, 10), "codes": (2, 2, 6, 10)},
              "center": {"heatmap": (2, 10, 16, 16), "regression": (2, 10, 16, 16)}}[head]  # fmt: skip
    outputs = {key: torch.randn(shape, generator=g, requires_grad=True) for key, shape in shapes.items()}

    def loss_and_gradients(velocity: float):
        unknown = [b.clone() for b in boxes]
        unknown[1][0, 7:] = velocity
        loss = _head_loss(head, unknown, outputs)
        return loss.detach(), torch.autograd.grad(loss, list(outputs.values()))

    m = 10.0
    assert all(o.abs().max() < m for o in outputs.values())
    loss, grads = loss_and_gradients(float("nan"))
    (plus, g_plus), (minus, g_minus), (twice, _) = (loss_and_gradients(v) for v in (m, -m, 2 * m))
    assert loss.isfinite() and all(grad.isfinite().all() for grad in grads)
    torch.testing.assert_close(loss, (plus + minus) / 2 - (twice - plus), rtol=1e-5, atol=0)
    for grad, a, b in zip(grads, g_plus, g_minus):
        torch.testing.assert_close(grad, (a + b) / 2, rtol=1e-5, atol=1e-7)


def test_a_bad_target_fails_the_matching_naming_the_box_not_the_training():
    """Called without the batch check (no Trainer): a NaN in a target is the data's fault, and says so."""
    head = QueryHead(16, 10, RANGE)
    boxes = random_boxes(3, torch.Generator().manual_seed(3))
    boxes[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"matching of sample 0: its box row 2 encodes to NaN or inf .*repair or drop"):
        head.match(torch.randn(1, 1, 8, 10), torch.randn(1, 1, 8, 10), [box_code.encode(boxes)], [torch.arange(3)])


# --- how each module assembles geometry and features ----------------------------------------------------


def test_petr_position_encoder_sees_each_cells_own_frustum():
    model = PETR.tiny()
    inputs = []
    model.position.encoder.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    lidar2img = rig(6, 32, 88)[2].expand(2, -1, -1, -1)
    model.position(torch.randn(12, 32, 2, 6), lidar2img, (32, 88))
    points = frustum_to_ego(lidar2img, model.position.depths, (2, 6), (32, 88))  # (2, 6, D, 2, 6, 3)
    low, high = torch.tensor(RANGE[:3]), torch.tensor(RANGE[3:])
    for b, n, i, j in [(0, 0, 0, 0), (1, 4, 1, 5), (0, 2, 1, 3)]:
        # Compared after a sigmoid: the inverse sigmoid is ill-conditioned at the range border.
        expected = ((points[b, n, :, i, j] - low) / (high - low)).clamp(1e-5, 1 - 1e-5).flatten()
        torch.testing.assert_close(inputs[0][b * 6 + n, :, i, j].sigmoid(), expected)


def test_lift_splat_pools_each_frustum_point_into_its_bev_cell():
    model = LiftSplat.tiny()  # 32 x 32 cells of 3.2 m, depth bins linspace(1, 60, 8)
    _, cam2ego, lidar2img = rig(6, 16, 48)  # 1 x 3 features: cell (0, 1) lies on the optical axis
    volume = torch.zeros(2 * 6, 16, 8, 1, 3)
    value = torch.randn(16)
    volume[6 + 1, :, 2, 0, 1] = value  # sample 1, camera 1, depth bin 2
    volume[0, :, 7, 0, 1] = torch.randn(16)  # sample 0, camera 0, 60 m ahead: outside the range
    bev = model.splat(volume, lidar2img.expand(2, -1, -1, -1), (16, 48))
    point = cam2ego[1, :3, 3] + model.depths[2] * cam2ego[1, :3, 2]
    expected = torch.zeros(2, 16, 32, 32)
    expected[1, :, int((point[0] + 51.2) // 3.2), int((point[1] + 51.2) // 3.2)] = value
    torch.testing.assert_close(bev, expected)


def test_simple_bev_averages_the_cameras_that_see_each_voxel():
    model = SimpleBEV.tiny()  # 32 x 32 cells of 3.2 m, 4 heights of 2 m from -5 m
    lidar2img = rig(6, 32, 88)[2]
    per_camera = torch.randn(6, 3)
    features = per_camera[:, :, None, None].expand(6, 3, 4, 11)  # constant over each camera's image
    bev = model.lift(features, lidar2img[None], (32, 88)).view(3, 4, 32, 32)
    centres = -51.2 + (torch.arange(32) + 0.5) * 3.2
    z, x, y = torch.meshgrid(torch.tensor([-4.0, -2.0, 0.0, 2.0]), centres, centres, indexing="ij")
    camera = torch.einsum("nij,zxyj->nzxyi", lidar2img, torch.stack([x, y, z, torch.ones_like(z)], -1))
    u, v, depth = camera[..., 0] / camera[..., 2], camera[..., 1] / camera[..., 2], camera[..., 2]
    seen = (depth > 0) & (u >= -0.5) & (u <= 87.5) & (v >= -0.5) & (v <= 31.5)
    # Between the outermost feature-cell centres (pixels 3.5 .. 83.5 and 3.5 .. 27.5) bilinear sampling of a
    # constant map returns the constant; nearer the border grid_sample blends in its zero padding.
    interior = (u >= 3.5) & (u <= 83.5) & (v >= 3.5) & (v <= 27.5)
    clean = ~(seen & ~interior).any(0)
    expected = (seen[:, None] * per_camera[:, :, None, None, None]).sum(0) / seen.sum(0).clamp(min=1)
    assert clean.sum() > 3000 and (seen.sum(0)[clean] == 2).sum() > 50  # includes overlaps of two cameras
    torch.testing.assert_close(bev[:, clean], expected[:, clean])


@pytest.mark.parametrize("name, skip, deep", [("resnet18", 64, 256), ("resnet34", 64, 256), ("resnet50", 256, 1024)])
def test_the_resnet_bev_encoder_returns_to_the_grid_with_the_trunks_widths(name, skip, deep):
    """Lift-Splat-Shoot's layout on timm's stages: the stem and layer1 at stride 2, layer2 at 4, layer3 at 8, then
    back at the grid's size (40 x 24, not square); the skip takes layer1's and layer3's widths as the model has them."""
    encoder = ResNetBEVEncoder(name, 16, 24)
    shapes = {}
    for part in ("stem", "layer1", "layer2", "layer3"):
        getattr(encoder, part).register_forward_hook(lambda m, a, out, part=part: shapes.update({part: out.shape[1:]}))
    with torch.no_grad():
        out = encoder(torch.randn(2, 16, 40, 24))
    assert out.shape == (2, 24, 40, 24)
    assert [tuple(shapes[p][1:]) for p in ("stem", "layer1", "layer2", "layer3")] == [
        (20, 12),
        (20, 12),
        (10, 6),
        (5, 3),
    ]
    assert (shapes["layer1"][0], shapes["layer3"][0], encoder.fuse[0].in_channels) == (skip, deep, skip + deep)


# --- modules --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_reaches_every_parameter(name):
    model, batch = _model_and_batch(name, batch=2, cameras=6)
    seen = []
    model.encoder.backbone.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    losses = model.loss(model(batch), batch)
    losses["loss"].backward()
    frames = 2 if name in TEMPORAL else 1
    assert seen == [(2 * 6, 3, 32, 88)] * frames if name.startswith("bevformer") else [(2 * 6 * frames, 3, 32, 88)]
    assert torch.isfinite(losses["loss"]) and all(t > 0 for t in _terms(losses))
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    # (PETR's first self-attention acts on the all-zero initial queries, so some of its gradients are zero.)
    first = next(model.encoder.backbone.parameters())
    assert first.grad.abs().sum() > 0 and all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", list(MODELS))
def test_overfitting_one_batch_lowers_both_loss_terms(name):
    model, batch = _model_and_batch(name, batch=1, cameras=6)
    optimizer = model.configure_optimizers()
    history = []
    for _ in range(25):
        losses = model.loss(model(batch), batch)
        optimizer.zero_grad()
        losses["loss"].backward()
        optimizer.step()
        history.append([t.item() for t in _terms(losses)])
    (cls0, box0), (cls1, box1) = history[0], history[-1]
    assert cls1 < 0.8 * cls0 and box1 < 0.9 * box0, history


@pytest.mark.parametrize("name", list(MODELS))
def test_predictions_have_the_metric_format(name):
    model, batch = _model_and_batch(name, batch=2, cameras=6)
    model.eval()
    with torch.no_grad():
        predictions = model.predict_step(batch, 0)
    assert len(predictions) == 2
    for p in predictions:
        n = p["scores"].shape[0]
        assert n > 0 and p["boxes"].shape == (n, 9) and p["labels"].shape == (n,)
        assert p["labels"].dtype == torch.long and 0 <= p["labels"].min() and p["labels"].max() < 10
        assert (p["scores"][:-1] >= p["scores"][1:]).all() and (p["boxes"][:, 3:6] > 0).all()
        assert p["boxes"][:, 6].abs().max() <= math.pi


@pytest.mark.parametrize("name", list(MODELS))
def test_empty_scene_trains_the_no_object_class_only(name):
    model, batch = _model_and_batch(name, batch=2, cameras=6, boxes=0)
    losses = model.loss(model(batch), batch)
    classification, box = _terms(losses)
    assert classification > 0 and box == 0 and box.requires_grad
    losses["loss"].backward()
    assert model.head.heatmap[-1].weight.grad is not None if hasattr(model.head, "heatmap") else True
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", list(MODELS))
def test_bad_input_raises_before_the_backbone_runs(name):
    model, batch = _model_and_batch(name, batch=2, cameras=6)
    calls = []
    model.encoder.backbone.register_forward_pre_hook(lambda *_: calls.append(1))
    wrong_cameras = {**batch, "lidar2img": batch["lidar2img"][:, :5]}
    with pytest.raises(ValueError, match=r"lidar2img must be .*\(2, 6, 4, 4\).*got \(2, 5, 4, 4\)"):
        model(wrong_cameras)
    _, _, large = rig(6, 96, 264)  # calibration of 3x larger images
    wrong_size = {**batch, "lidar2img": large.expand(2, -1, -1, -1)}
    with pytest.raises(ValueError, match=r"lidar2img\[0, 0\] has its principal point at \(u, v\) = \(131.5, 47.5\)"):
        model(wrong_size)
    with pytest.raises(ValueError, match=r"images must be \(B, N, 3, H, W\), got \(12, 3, 32, 88\)"):
        model({**batch, "images": batch["images"].flatten(0, 1)})
    singular = batch["lidar2img"].clone()
    singular[1, 4, 3] = 0  # a projection that lost its homogeneous row
    with pytest.raises(ValueError, match=r"lidar2img\[1, 4\] is singular, so no pixel maps back to a ray"):
        model({**batch, "lidar2img": singular})
    assert not calls


NAN, INF = float("nan"), float("inf")


def _box(batch, sample: int, row: int, field: int, value: float) -> dict:
    boxes = [b.clone() for b in batch["boxes"]]
    boxes[sample][row, field] = value
    return {**batch, "boxes": boxes}


def _label(batch, sample: int, row: int, value: int) -> dict:
    labels = [lab.clone() for lab in batch["labels"]]
    labels[sample][row] = value
    return {**batch, "labels": labels}


BAD_BATCHES = {  # name -> (a good batch made bad, the message)
    "nan_z": (lambda b: _box(b, 1, 0, 2, NAN), r"batch sample 1: boxes row 0 has z = nan: only vx, vy may be NaN"),
    "inf_vx": (lambda b: _box(b, 0, 2, 7, INF), r"batch sample 0: boxes row 2 has vx = inf: only vx, vy may be NaN"),
    "zero_length": (lambda b: _box(b, 1, 1, 4, 0.0), r"batch sample 1: boxes row 1 has l = 0.0: sizes w, l, h must"),
    "negative_width": (lambda b: _box(b, 0, 0, 3, -2.0), r"batch sample 0: boxes row 0 has w = -2.0: sizes w, l, h"),
    "label_of_no_class": (
        lambda b: _label(b, 1, 2, 10),
        r"batch sample 1: labels row 2 is 10, outside \[0, 10\): the model has num_classes=10 \(set it to the data",
    ),
    "negative_label": (lambda b: _label(b, 0, 1, -1), r"batch sample 0: labels row 1 is -1, outside \[0, 10\)"),
    "int32_labels": (
        lambda b: {**b, "labels": [lab.int() for lab in b["labels"]]},
        r"batch sample 0: labels must be int64 \(3,\) to match the boxes, got torch.int32",
    ),
    "uint8_images": (
        lambda b: {**b, "images": b["images"].mul(50).clamp(0, 255).to(torch.uint8)},
        r"images are torch.uint8 but the model's parameters are torch.float32: give torch.float32 images",
    ),
    "float64_images": (
        lambda b: {**b, "images": b["images"].double()},
        r"images are torch.float64 but the model's parameters are torch.float32",
    ),
    "boxes_of_7_values": (
        lambda b: {**b, "boxes": [x[:, :7] for x in b["boxes"]]},
        r"boxes\[0\] must be \(m, 9\) and labels\[0\] \(m,\), got \(3, 7\) and \(3,\)",
    ),
}


class NoOptimizerStep(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        raise AssertionError("an optimizer step ran on a bad batch")


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_a_bad_batch_fails_before_any_optimizer_step_naming_the_field_and_sample(case):
    """Checked on the host (``on_before_batch_transfer``; the images' dtype in ``forward``): Lift-Splat trained on
    with a NaN loss, PETR blamed the training, the rest failed deep in a kernel."""
    torch.manual_seed(0)
    model = LiftSplat.tiny()
    before = [p.detach().clone() for p in model.parameters()]
    edit, message = BAD_BATCHES[case]
    batch = edit(surround_batch(batch=2, cameras=2))
    with pytest.raises(ValueError, match=message):
        _quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[NoOptimizerStep()]).fit(model, _loader([batch]))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("detector", [PETR, LiftSplat, SimpleBEV, BEVFormer], ids=lambda c: c.__name__)
def test_every_detector_checks_labels_against_its_own_classes_and_accepts_unknown_velocities(detector):
    model, batch = detector.tiny(num_classes=3), surround_batch(batch=2, cameras=2, classes=3)
    unknown = _box(_box(batch, 1, 2, 7, NAN), 1, 2, 8, NAN)  # the devkit's velocity of a lone annotation
    assert model.on_before_batch_transfer(unknown, 0) is unknown
    with pytest.raises(ValueError, match=r"batch sample 0: labels row 1 is 3, outside \[0, 3\): the model has num_c"):
        model.on_before_batch_transfer(_label(batch, 0, 1, 3), 0)


def test_a_bad_box_fails_on_every_rank_under_spatial_tp():
    """The check reads the replicated boxes beside the sharded images, on the host: every rank raises alike."""
    torch.manual_seed(0)
    batch = _box(surround_batch(batch=1, cameras=2, height=64, width=96), 0, 1, 5, -1.0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpatialParallelStrategy(2, start_method="fork"),
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[NoOptimizerStep()],
    )
    with pytest.raises(Exception, match=r"batch sample 0: boxes row 1 has h = -1.0: sizes w, l, h must be > 0"):
        trainer.fit(LiftSplat.tiny(), _loader([batch]))


def test_petrv2_needs_and_uses_the_previous_frame():
    model, batch = _model_and_batch("petrv2", batch=1, cameras=2)
    with pytest.raises(ValueError, match="prev_images"):
        model({k: v for k, v in batch.items() if k != "prev_images"})
    with pytest.raises(ValueError, match=r"prev_images must be .*\(1, 2, 3, 32, 88\).*got \(1, 2, 3, 32, 64\)"):
        model({**batch, "prev_images": batch["prev_images"][..., :64]})
    logits = model(batch)["logits"]
    moved = {**batch, "prev_lidar2img": batch["lidar2img"]}  # same images, no ego motion
    assert not torch.allclose(model(moved)["logits"], logits)
    assert not torch.allclose(model({**batch, "prev_images": -batch["prev_images"]})["logits"], logits)


def test_bevformer_needs_and_uses_the_previous_frame_and_its_camera_count():
    model, batch = _model_and_batch("bevformer_temporal", batch=1, cameras=6)
    with pytest.raises(ValueError, match="prev_images"):
        model({k: v for k, v in batch.items() if k != "prev_images"})
    logits = model(batch)["logits"]
    assert not torch.allclose(model({**batch, "prev_images": -batch["prev_images"]})["logits"], logits)
    assert not torch.allclose(model({**batch, "prev_lidar2img": batch["lidar2img"]})["logits"], logits)
    with pytest.raises(ValueError, match=r"images hold 2 cameras but the model's camera embedding has num_cameras=6"):
        model(surround_batch(batch=1, cameras=2, temporal=True))


def test_deformable_sampling_at_cell_centres_reads_the_cells():
    """A sampling location at a value cell's centre reads that cell; the weights mix the points and levels."""
    from lightning_spatial.models.bev.deformable import deformable_sample

    g = torch.Generator().manual_seed(0)
    maps = [torch.randn(2, 3, 4, 6, generator=g, dtype=torch.float64), torch.randn(2, 3, 2, 3, generator=g).double()]
    rows, cols = torch.randint(0, 2, (2, 5, 7), generator=g), torch.randint(0, 3, (2, 5, 7), generator=g)
    locations = torch.zeros(2, 2, 2, 5, 7, 2, dtype=torch.float64)  # (B', L, P, X, Y, 2)
    for level, value in enumerate(maps):
        h, w = value.shape[-2:]
        locations[:, level, ..., 0] = (cols[:, None].double() + 0.5) / w  # point 0 and point 1 at the same cell
        locations[:, level, ..., 1] = (rows[:, None].double() + 0.5) / h
    weights = torch.rand(2, 2, 2, 5, 7, generator=g, dtype=torch.float64)
    expected = sum(
        value[torch.arange(2)[:, None, None, None], torch.arange(3)[None, :, None, None], rows[:, None], cols[:, None]]
        * weights[:, level].sum(1)[:, None]  # both points read the same cell
        for level, value in enumerate(maps)
    )
    torch.testing.assert_close(
        deformable_sample(maps, lambda level: (locations[:, level], weights[:, level])), expected
    )


def test_deformable_sampling_keeps_its_inputs_for_the_backward_not_its_samples():
    """As mmcv's kernel, ``deformable_sample`` samples again in the backward: autograd keeps the maps and what the
    points are made of, never a level's P samples per query cell (P times the output); the gradients are those of
    sampling and weighting in one go."""
    from lightning_spatial.models.bev.deformable import deformable_sample

    g = torch.Generator().manual_seed(0)
    maps = [torch.randn(2, 8, 7, 9, generator=g, dtype=torch.float64), torch.randn(2, 8, 4, 5, generator=g).double()]
    locations = torch.rand(2, 2, 4, 6, 5, 2, generator=g, dtype=torch.float64)  # (B', L, P, X, Y, 2)
    weights = torch.rand(2, 2, 4, 6, 5, generator=g, dtype=torch.float64)
    ours = [t.clone().requires_grad_() for t in (*maps, locations, weights)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = deformable_sample(ours[:2], lambda level: (ours[2][:, level], ours[3][:, level]))
    samples = 2 * 8 * 4 * 6 * 5  # one level's samples
    assert saved and max(saved) < samples, saved
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(upstream)
    plain = [t.clone().requires_grad_() for t in (*maps, locations, weights)]
    expected = sum(
        (
            F.grid_sample(value, (2 * plain[2][:, level] - 1).flatten(1, 2), align_corners=False).unflatten(2, (4, 6))
            * plain[3][:, level, None]
        ).sum(2)
        for level, value in enumerate(plain[:2])
    )
    expected.backward(upstream)
    torch.testing.assert_close(out, expected)
    for name, a, b in zip(("map 0", "map 1", "locations", "weights"), ours, plain):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_spatial_cross_attention_keeps_its_queries_offsets_not_every_cameras_locations():
    """The cross-attention's sampling locations and weights are per camera (N times its queries' offsets): made
    again in the backward from the offsets, never kept; the output and every gradient are those of the same
    computation kept whole."""
    from lightning_spatial.models.bev.deformable import SpatialCrossAttention

    g = torch.Generator().manual_seed(0)
    b, n, nx, ny, c, heads, levels, anchors, points = 1, 6, 8, 8, 16, 2, 2, 4, 2
    shapes = [(3, 4), (2, 2)]
    attention = SpatialCrossAttention(c, heads, levels, anchors, points).double()
    with torch.no_grad():  # random offsets and weights (the initialisation's are zero)
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    queries = torch.randn(b, nx, ny, c, generator=g, dtype=torch.float64, requires_grad=True)
    position = torch.randn(nx, ny, c, generator=g, dtype=torch.float64)
    tokens = torch.randn(b * n, sum(h * w for h, w in shapes), c, generator=g, dtype=torch.float64, requires_grad=True)
    reference = torch.rand(b, n, nx, ny, anchors, 2, generator=g, dtype=torch.float64)
    hit = (torch.rand(b, n, nx, ny, generator=g) > 0.3).double()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = attention(queries, position, tokens, shapes, reference, hit)
    per_camera = b * n * heads * anchors * points * nx * ny  # one level's weights for every camera
    assert saved and max(saved) < per_camera, (max(saved), per_camera)
    cameras_and_heads = [o for o in gc.get_objects() if torch.is_tensor(o) and o.dim() and o.shape[0] == b * n * heads]
    held = [tuple(t.shape) for t in cameras_and_heads if t.numel() >= per_camera]
    assert not held, held  # nor held by the backward's closures
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(upstream)
    grads = [queries.grad, tokens.grad, *(p.grad for p in attention.parameters())]
    queries.grad = tokens.grad = None
    attention.zero_grad()
    whole = _cross_attention_sample_by_sample(attention, queries, position, tokens, shapes, reference, hit)
    whole.backward(upstream)
    torch.testing.assert_close(out, whole)
    for a, e in zip(grads, [queries.grad, tokens.grad, *(p.grad for p in attention.parameters())], strict=True):
        torch.testing.assert_close(a, e)


def _cross_attention_sample_by_sample(attention, queries, position, tokens, shapes, reference, hit):
    """BEVFormer's spatial cross-attention, one ``grid_sample`` per camera, head, level, anchor and point."""
    b, nx, ny, c = queries.shape
    n, heads, levels, anchors, points = (
        hit.shape[1],
        attention.heads,
        attention.levels,
        attention.anchors,
        attention.points,
    )
    ch = c // heads
    q = queries + position
    offsets = attention.offsets(q).view(b, nx, ny, heads, levels, anchors, points, 2)
    weights = (
        attention.weights(q).view(b, nx, ny, heads, -1).softmax(-1).view(b, nx, ny, heads, levels, anchors, points)
    )
    values = attention.value(tokens).view(b, n, -1, heads, ch)
    out = [[0] * heads for _ in range(n)]
    start = 0
    for level, (h, w) in enumerate(shapes):
        maps = values[:, :, start : start + h * w].unflatten(2, (h, w))  # (B, N, h, w, heads, ch)
        start += h * w
        for k, e, a, p in itertools.product(range(n), range(heads), range(anchors), range(points)):
            at = reference[:, k, :, :, a] + offsets[:, :, :, e, level, a, p] / torch.tensor([w, h], dtype=q.dtype)
            sample = F.grid_sample(maps[:, k, :, :, e].permute(0, 3, 1, 2), 2 * at - 1, align_corners=False)
            out[k][e] = out[k][e] + sample * weights[:, None, :, :, e, level, a, p]
    out = torch.stack([torch.cat(per_head, 1) for per_head in out], 1) * hit[:, :, None]  # (B, N, C, X, Y)
    out = out.sum(1) / hit.sum(1)[:, None].clamp(min=1)
    return attention.output(out.permute(0, 2, 3, 1))


def test_bevformer_pillars_are_the_projected_cell_centres_and_hit_where_a_camera_sees_them():
    model = BEVFormer.tiny(num_cameras=6)
    _, _, lidar2img = rig(6, 32, 88)
    reference, hit = model.pillars(lidar2img[None], (32, 88))
    assert reference.shape == (1, 6, 8, 8, 4, 2) and hit.shape == (1, 6, 8, 8)
    r = model.grid.point_cloud_range
    i, j, k = 6, 3, 1  # a cell ahead of camera 0 (x forward), at the second of four heights
    cx, cy = model.grid.centres()[i, j].tolist()
    point = torch.tensor([[cx, cy, r[2] + 1.5 * (r[5] - r[2]) / 4]])
    grid, valid = project(point, lidar2img[None], (32, 88))
    torch.testing.assert_close(reference[0, :, i, j, k], (grid[0, :, 0] + 1) / 2)
    assert valid[0, 0, 0] == 1 and hit[0, 0, i, j] == 1 and hit[0, 3, i, j] == 0  # camera 3 looks backwards


# --- query denoising -----------------------------------------------------------------------------------


def test_denoising_queries_start_inside_their_box_and_far_ones_mean_no_object():
    g = torch.Generator().manual_seed(3)
    boxes, labels = [random_boxes(3, g), random_boxes(1, g)], [torch.tensor([2, 5, 7]), torch.tensor([4])]
    low, high = torch.tensor(RANGE[:3]), torch.tensor(RANGE[3:])
    torch.manual_seed(0)
    dn = denoising_queries(boxes, labels, groups=4, num_queries=5, low=low, extent=high - low, split=0.75)
    assert dn.reference.shape == (2, 12, 3) and dn.mask.shape == (17, 17)  # 4 groups of 3 (the most boxes)
    assert torch.equal(dn.boxes[0], boxes[0].repeat(4, 1)) and torch.equal(dn.boxes[1, 0::3], boxes[1].repeat(4, 1))
    assert dn.real[1].tolist() == [True, False, False] * 4 and dn.real[0].all()
    real = dn.real
    jitter = (dn.reference * (high - low) + low - dn.boxes[..., :3])[real] / (dn.boxes[real][:, 3:6] / 2)
    far = jitter.norm(dim=-1) > 0.75
    assert (jitter.abs() <= 1 + 1e-4).all() and far.any() and (~far).any()
    given = torch.stack([torch.tensor([2, 5, 7]), torch.tensor([4, -1, -1])]).repeat(1, 4)[real]
    assert torch.equal(dn.labels[real], torch.where(far, -1, given))
    for i in range(17):  # a denoising query sees its own group and the matching queries; those only each other
        allowed = [(j < 12 and i < 12 and i // 3 == j // 3) or j >= 12 for j in range(17)]
        assert (~dn.mask[i]).tolist() == allowed, i


def test_denoising_trains_without_changing_the_matching_queries():
    torch.manual_seed(0)
    model, plain = PETR.tiny(denoise_groups=3), PETR.tiny()
    plain.load_state_dict(model.state_dict())
    batch = surround_batch(batch=2, cameras=2)
    outputs, reference = model(batch), plain(batch)
    torch.testing.assert_close(outputs["logits"], reference["logits"])
    torch.testing.assert_close(outputs["codes"], reference["codes"])
    logits, codes, denoise = outputs["denoise"]
    assert logits.shape == (2, 2, 9, 10) and codes.shape == (2, 2, 9, 10)  # (layers, batch, 3 groups x 3 boxes)
    losses = model.loss(outputs, batch)
    assert losses["loss_denoise"] > 0 and losses["loss"] > plain.loss(reference, batch)["loss"]
    losses["loss"].backward()
    assert model.reference_logits.grad.abs().sum() > 0 and model.query_embedding[0].weight.grad.abs().sum() > 0
    model.eval()
    assert "denoise" not in model(batch)


def test_denoising_loss_vanishes_for_the_answers():
    head = QueryHead(16, 10, RANGE)
    g = torch.Generator().manual_seed(4)
    boxes, labels = [random_boxes(2, g)], [torch.tensor([3, 8])]
    low, high = torch.tensor(RANGE[:3]), torch.tensor(RANGE[3:])
    torch.manual_seed(0)
    dn = denoising_queries(boxes, labels, groups=3, num_queries=4, low=low, extent=high - low, split=0.75)
    answers = box_code.encode(dn.boxes)[None]
    confident = torch.full((1, 1, 6, 10), -30.0)
    positive = dn.labels >= 0
    confident[0][positive, dn.labels[positive]] = 30.0
    assert head.denoise_loss(confident, answers, dn) < 1e-6
    assert head.denoise_loss(confident, answers + 0.1, dn) > 0.2  # 0.25 x (8 x 0.1 + 2 x 0.02) per query
    assert head.denoise_loss(-confident, answers, dn) > 10


def test_denoising_loss_counts_the_real_queries_only():
    """Padding queries (a sample with fewer boxes than the batch's most) add nothing, whatever they predict:
    the loss is the sum over real queries, here written with boolean indexing (the masks avoid it)."""
    head, g = QueryHead(16, 10, RANGE), torch.Generator().manual_seed(5)
    boxes, labels = [random_boxes(3, g), random_boxes(1, g)], [torch.tensor([2, 5, 7]), torch.tensor([4])]
    low, high = torch.tensor(RANGE[:3]), torch.tensor(RANGE[3:])
    torch.manual_seed(0)
    dn = denoising_queries(boxes, labels, groups=2, num_queries=4, low=low, extent=high - low, split=0.75)
    logits, codes = torch.randn(3, 2, 6, 10, generator=g), torch.randn(3, 2, 6, 10, generator=g)
    real, positive = dn.real, dn.labels >= 0
    classes = torch.zeros(2, 6, 10)
    classes[positive, dn.labels[positive]] = 1
    target, weights = box_code.encode(dn.boxes[real]), torch.tensor(box_code.CODE_WEIGHTS)
    expected = sum(
        head.cls_weight * sigmoid_focal_loss(lo[real], classes[real]) / positive.sum()
        + head.box_weight * ((co[real] - target).abs() * weights).sum() / real.sum()
        for lo, co in zip(logits, codes)
    )
    torch.testing.assert_close(head.denoise_loss(logits, codes, dn), expected, rtol=1e-6, atol=0)
    wild_logits, wild_codes = logits.clone(), codes.clone()
    wild_logits[:, ~real], wild_codes[:, ~real] = 1e4, -1e4
    torch.testing.assert_close(head.denoise_loss(wild_logits, wild_codes, dn), expected, rtol=1e-6, atol=0)


# --- the Lightning loop ---------------------------------------------------------------------------------


class RecordingMetric(torchmetrics.Metric):
    """Stands in for lightning_spatial.metrics.NuScenesDetection: counts samples, checks the formats."""

    def __init__(self):
        super().__init__()
        self.add_state("samples", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, targets):
        assert len(preds) == len(targets)
        for p, t in zip(preds, targets):
            assert p["boxes"].shape[1] == 9 and t["boxes"].shape[1] == 9 and len(t["labels"]) == len(t["boxes"])
        self.samples += len(preds)

    def compute(self):
        return {"mAP": self.samples / 10, "NDS": self.samples / 20}


def _quiet_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kwargs,
    )


def _loader(batches: list) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def test_trainer_fits_validates_with_a_metric_and_predicts():
    torch.manual_seed(0)
    model = LiftSplat.tiny(metric=RecordingMetric())
    batches = [surround_batch(batch=1, cameras=2, seed=s) for s in range(2)]

    trainer = _quiet_trainer(max_steps=2)
    trainer.fit(model, _loader(batches), _loader(batches))
    assert trainer.callback_metrics["val_mAP"] == pytest.approx(0.2)  # 2 samples validated
    assert trainer.callback_metrics["val_NDS"] == pytest.approx(0.1)
    assert {"train_loss", "val_loss", "val_loss_heatmap"} <= set(trainer.callback_metrics)
    predictions = trainer.predict(model, _loader(batches))
    assert len(predictions) == 2 and predictions[0][0]["boxes"].shape[1] == 9
    assert model.hparams.bev_size == (32, 32) and "metric" not in model.hparams


def test_validation_hands_the_metric_attributes_and_ignore_regions():
    class Targets(torchmetrics.Metric):
        """Keeps the targets validation hands over."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def update(self, preds, targets):
            self.seen += targets

        def compute(self):
            return {}

    torch.manual_seed(0)
    model = LiftSplat.tiny(metric=Targets())
    batch = surround_batch(batch=2, cameras=2, boxes=3)
    batch["attributes"] = [torch.tensor([5, -1, 3]), torch.tensor([0, 7, -1])]
    batch["ignore_regions"] = [torch.randn(2, 7), torch.randn(0, 7)]
    _quiet_trainer().validate(model, _loader([batch]))
    assert len(model.val_metric.seen) == 2
    for i, target in enumerate(model.val_metric.seen):
        assert target.keys() == {"boxes", "labels", "attributes", "ignore_regions"}
        assert all(torch.equal(target[key], batch[key][i]) for key in target)


@pytest.mark.parametrize("name", ["petr", "lift_splat", "simple_bev", "bevformer"])
def test_warmup_ramps_the_learning_rate_per_step(name):
    """Every parameter's rate ramps; the image backbone's is lr x backbone_lr_mult."""
    model = {"petr": PETR, "lift_splat": LiftSplat, "simple_bev": SimpleBEV, "bevformer": BEVFormer}[name].tiny(
        warmup_steps=4, lr=1e-3, backbone_lr_mult=0.1
    )
    batches = [surround_batch(batch=1, cameras=2, seed=s) for s in range(6)]
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append([group["lr"] for group in trainer.optimizers[0].param_groups])

    trainer = _quiet_trainer(max_steps=6, callbacks=[Record()], limit_val_batches=0)
    trainer.fit(model, _loader(batches))
    ramp = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert seen == [pytest.approx([1e-3 * r, 1e-4 * r]) for r in ramp]
    groups = trainer.optimizers[0].param_groups
    backbone = {id(p) for p in model.encoder.backbone.parameters()}
    assert {id(p) for p in groups[1]["params"]} == backbone
    assert len(groups[0]["params"]) + len(backbone) == len(list(model.parameters()))


def _validate(model: L.LightningModule, batches: list, strategy, devices: int) -> dict[str, float]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(model, _loader(batches), verbose=False)
    return metrics


@pytest.mark.parametrize(
    "detector, options",
    [(PETR, dict(num_queries=0)), (LiftSplat, {})],  # no queries: no predictions at all; or empty scenes alone
    ids=["petr_no_queries", "lift_splat"],
)
def test_validation_of_empty_scenes_and_predictions_under_spatial_tp_scores_as_one_device(detector, options):
    """Samples and a whole batch without boxes, and a model that predicts nothing: the losses and the nuScenes
    metric under width 2 equal one device's (float64)."""
    from lightning_spatial.metrics import NuScenesDetection

    batches = [
        surround_batch(batch=2, cameras=2, height=64, width=96, boxes=b, seed=s) for s, b in enumerate([[0, 2], [0, 0]])
    ]
    results = []
    for strategy, devices in (("auto", 1), (SpatialParallelStrategy(2, start_method="fork", fallback="error"), 2)):
        torch.manual_seed(0)
        results.append(_validate(detector.tiny(metric=NuScenesDetection(), **options), batches, strategy, devices))
    one, ours = results
    assert set(ours) == set(one) and {"val_loss", "val_mAP", "val_NDS"} <= set(one), set(one)
    for key, expected in one.items():
        assert ours[key] == pytest.approx(expected, rel=1e-11, abs=1e-12, nan_ok=True), key
