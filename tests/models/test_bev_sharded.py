"""The unchanged BEV modules on width-sharded images (2 gloo ranks, float64): loss and image gradient equal the
single-process ones, with every op on a spatial handler: Lift-Splat's voxel pooling (``index_add``), PETRv2's
cross-attention over camera tokens and, with the BEV plane sharded, the ResNet BEV encoder included; empty inputs
too (no queries, samples and whole batches without boxes), as on one device. No op may take the gather fallback
(the run's ``fallback="error"``), so a new fallback fails here."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_spatial import SpatialTensor, shard
from lightning_spatial.layout import LayoutError
from lightning_spatial.models.bev import PETR, BEVFormer, LiftSplat, SimpleBEV
from lightning_spatial.run import Run, entered
from lightning_spatial.strategies._scopes import cutting_bev_planes
from tests.host import HostRoundTrips, waits
from tests.models.surround import surround_batch
from tests.oracle import assert_rel_close, check
from tests.spmd import LAYOUTS, axes, run_spmd

CASES = {  # name -> (model, its options, box counts per sample)
    "lift_splat": (LiftSplat.tiny, {}, [3]),  # voxel pooling of the frustum features: ops.index
    "simple_bev": (SimpleBEV.tiny, {}, [3]),
    "lift_splat_resnet": (LiftSplat.tiny, dict(bev_encoder="resnet18"), [3]),  # the replicated BEV's ResNet
    "simple_bev_resnet": (SimpleBEV.tiny, dict(bev_encoder="resnet18"), [3]),
    "petrv2": (PETR.tiny, dict(temporal=True, feature_guided_pe=True), [3]),  # cross-attention: ops.attention
    "petr_denoising": (PETR.tiny, dict(denoise_groups=2), [3]),  # extra queries, a self-attention mask
    # empty inputs: a sample without boxes beside one with boxes, a batch without any, no matching queries
    "lift_splat_empty_sample": (LiftSplat.tiny, {}, [0, 2]),
    "simple_bev_empty_batch": (SimpleBEV.tiny, {}, [0, 0]),
    "petr_empty_batch": (PETR.tiny, dict(denoise_groups=2), [0, 0]),
    "petr_no_queries": (PETR.tiny, dict(num_queries=0), [3]),
    "petr_no_queries_denoising": (PETR.tiny, dict(num_queries=0, denoise_groups=2), [2, 0]),
}


def _as(batch: dict, dtype: torch.dtype) -> dict:
    """The batch's floating tensors in ``dtype``."""
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def _case(name, bev_shard=None):
    make, options, boxes = CASES[name]
    torch.manual_seed(0)
    model = make(**options).double()
    temporal = options.get("temporal", False)
    batch = surround_batch(batch=len(boxes), cameras=2, height=32, width=96, boxes=boxes, temporal=temporal)
    batch = _as(batch, torch.float64)

    names = [k for k in ("images", "prev_images") if k in batch]  # sharded like the strategy's collate does
    embedded = []  # what PETR's 3-D position MLP embeds: this rank's columns of the frustum, not all of them
    if isinstance(model, PETR):
        model.position.encoder.register_forward_pre_hook(lambda module, args: embedded.append(args[0]))

    def loss(*images):
        torch.manual_seed(1)  # the same denoising queries on one process and on the shards
        return model.loss(model({**batch, **dict(zip(names, images))}), batch)["loss"]

    check(loss, [batch[k] for k in names], sharded=range(len(names)), axes=axes("w2"), bev_shard=bev_shard)
    on_shards = [x for x in embedded if isinstance(x, SpatialTensor) and x.shard_layout.shards]
    assert len(on_shards) == len(embedded) / 2, [type(x).__name__ for x in embedded]  # the sharded run's half
    assert bool(embedded) == isinstance(model, PETR)


@pytest.mark.parametrize("name", list(CASES))
def test_module_is_exact_on_width_sharded_images(name):
    run_spmd(_case, 2, name, timeout=300)


@pytest.mark.parametrize("name", ["petrv2", "petr_denoising"])
def test_petr_is_unaffected_by_bev_shard(name):
    """PETR has no BEV grid: with ``bev_shard`` set it runs as without it (exact, no fallback)."""
    run_spmd(_case, 2, name, "xy", timeout=300)


def _bev_plane_case(name: str, layout: str, mode: str, encoder: str):
    """The BEV plane sharded too (``bev_shard``): the splat ends sharded over the grid's cells, and the BEV encoder
    (the conv stack, or the ResNet: a 7x7 stride-2 stem, strided stages, bilinear x4 and x2 upsampling with
    ``align_corners=True``, a concatenated skip), the CenterPoint head, its loss and its decoding run on them, no
    fallback; loss, image gradient, every parameter gradient and BatchNorm buffer, and the decoded boxes equal one
    process's."""
    make = {"lift_splat": LiftSplat.tiny, "simple_bev": SimpleBEV.tiny}[name]
    torch.manual_seed(0)
    reference = make(bev_encoder=encoder).double()
    if encoder != "convs":  # timm zeroes each block's last BatchNorm scale: random ones let every conv reach the loss
        for m in reference.bev_encoder.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    ours = copy.deepcopy(reference)
    height = 64 if layout == "2x2" else 32  # image rows for two ranks at the backbone's stride 32
    batch = surround_batch(batch=2, cameras=2, height=height, width=96, boxes=[3, 1])
    batch = _as(batch, torch.float64)
    decoded = []

    def loss(images):
        model = ours if isinstance(images, SpatialTensor) else reference
        outputs = model({**batch, "images": images})
        assert isinstance(outputs["heatmap"], SpatialTensor) == (model is ours)  # the head ran on shards
        decoded.append(model.head.decode(outputs))
        return model.loss(outputs, batch)["loss"]

    check(loss, [batch["images"]], sharded=[0], axes=axes(layout), modules=(reference, ours), bev_shard=mode)
    for theirs, mine in zip(*decoded):  # per sample
        _same_detections(mine, theirs)


def _same_detections(mine: dict, theirs: dict) -> None:
    """The same top-k detections: the distinct scores (sorted) to float64 rounding down to the higher of the two
    lowest, and every detection whose score no other one ties has a box of its label among ours. A plateau of the
    heatmap (cells no camera sees score alike) is a peak at each of its cells where they are equal to the bit, and at
    fewer where rounding sets them a hair apart, so a score may be there more often on one side (and the list end
    lower on the other); scores that tie up to rounding may also come in either order."""
    margin = 1e-9 * theirs["scores"].abs().max()
    floor = max(mine["scores"][-1], theirs["scores"][-1]) + margin
    distinct = [_distinct(d["scores"], margin) for d in (mine, theirs)]
    assert_rel_close(*(d[d > floor] for d in distinct), "decoded scores, each once")
    scale = theirs["boxes"].abs().max()
    tied = _tied(theirs["scores"], margin)
    for box, label, score, tie in zip(theirs["boxes"], theirs["labels"], theirs["scores"], tied):
        if score <= floor or tie:
            continue
        candidates = mine["boxes"][mine["labels"] == label]
        assert (candidates - box).abs().amax(-1).min() <= 1e-11 * scale, (box, label, score)


def _tied(scores: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """Per score (descending), whether a neighbour equals it up to ``margin``."""
    close = (scores[:-1] - scores[1:]) <= margin
    return torch.cat([close, close.new_zeros(1)]) | torch.cat([close.new_zeros(1), close])


def _distinct(scores: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """The descending scores with each run of ties up to ``margin`` kept once."""
    return scores[torch.cat([scores.new_ones(1, dtype=torch.bool), (scores[:-1] - scores[1:]) > margin])]


@pytest.mark.parametrize("layout,mode", [("w2", "x"), ("w3", "y"), ("2x2", "xy")])  # w3: 4 rows at stride 8
@pytest.mark.parametrize("encoder", ["convs", "resnet18"])
@pytest.mark.parametrize("name", ["lift_splat", "simple_bev"])
def test_bev_plane_sharded_is_exact(name, encoder, layout, mode):
    run_spmd(_bev_plane_case, LAYOUTS[layout][0], name, layout, mode, encoder, timeout=300)


def _bevformer_case(layout: str, mode: str | None, temporal: bool, dtype: torch.dtype, planes: bool):
    """BEVFormer on sharded cameras, and with ``bev_shard`` on a sharded BEV: every encoder layer's output is sharded
    over the BEV cells, no fallback; loss, image gradients and every parameter gradient equal one process's (a sample
    without boxes beside one with). With ``planes`` its learned BEV queries are cut to the rank's cells before the
    first layer (the strategy's ``bev_planes``), so every layer's temporal self-attention reads sharded queries;
    without, the first layer's spatial cross-attention cuts its samples to the rank's cells and the queries are
    replicated until its residual."""
    torch.manual_seed(0)
    reference = BEVFormer.tiny(temporal=temporal).to(dtype)
    ours = copy.deepcopy(reference)
    outputs, reads = [], []  # each encoder layer's output layout, and its temporal self-attention's queries'
    for layer in ours.bev_layers:
        layer.register_forward_hook(lambda m, args, out: outputs.append(getattr(out, "shard_layout", None)))
        layer.temporal.register_forward_pre_hook(lambda m, args: reads.append(getattr(args[0], "shard_layout", None)))
    height = 64 if layout == "2x2" else 32
    batch = surround_batch(batch=2, cameras=2, height=height, width=96, boxes=[3, 0], temporal=temporal)  # one empty
    batch = _as(batch, dtype)
    names = [k for k in ("images", "prev_images") if k in batch]

    def loss(*images):
        model = ours if isinstance(images[0], SpatialTensor) else reference
        return model.loss(model({**batch, **dict(zip(names, images))}), batch)["loss"]

    groups = axes(layout)
    cut = {"bev_queries": (0, 1)} if planes else {}
    with cutting_bev_planes(ours, cut, groups, mode):
        check(loss, [batch[k] for k in names], range(len(names)), groups, modules=(reference, ours), bev_shard=mode)
    layers = len(ours.bev_layers)
    assert [bool(x) for x in outputs] == [mode is not None] * layers * (1 + temporal), outputs
    frame = [mode is not None and planes] + [mode is not None] * (layers - 1)  # each frame's layers' queries
    assert [bool(x) for x in reads] == frame * (1 + temporal), reads
    assert len({x for x in outputs + reads if x}) <= 1, "the cut queries are laid out as the layers' outputs"


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,mode,temporal,dtype,planes",
    [
        ("w2", None, True, torch.float32, False),
        ("w3", None, False, torch.float64, False),
        ("w2", "x", True, torch.float64, True),
        ("w2", "x", False, torch.float64, False),  # the queries replicated until the first cross-attention
        ("w3", "y", False, torch.float64, True),  # fp32 whole models: the op tests (tests/ops/test_sample.py) hold 1e-5
        ("2x2", "x", False, torch.float64, True),
        ("2x2", "xy", True, torch.float64, True),
    ],
)
def test_bevformer_is_exact_with_cameras_and_bev_sharded(layout, mode, temporal, dtype, planes):
    run_spmd(_bevformer_case, LAYOUTS[layout][0], layout, mode, temporal, dtype, planes, timeout=600)


def _bev_rows_fewer_than_ranks():
    torch.manual_seed(0)
    model = BEVFormer.tiny(bev_size=(1, 8)).double()
    batch = surround_batch(batch=1, cameras=2, height=32, width=96, boxes=[2])
    batch = _as(batch, torch.float64)
    images = shard(batch["images"], axes("w2"))
    with entered(Run(fallback="error", bev_shard="x")), pytest.raises(LayoutError, match=r"has 1 cells along dim -2"):
        model({**batch, "images": images})


def test_a_bev_grid_with_fewer_rows_than_ranks_fails_naming_the_sizes():
    """BEVFormer's BEV queries sharded by rows (bev_shard="x") need at least a row per rank: its first cross-attention
    raises with the sizes and the fix, before any optimizer step."""
    run_spmd(_bev_rows_fewer_than_ranks, 2)


DETECTORS = {"lift_splat": LiftSplat, "simple_bev": SimpleBEV, "petr": PETR, "bevformer": BEVFormer}
HOST_BY_DESIGN = {
    "batch.check_contents",  # forward reads the batch's values only while the batch is on the host (before transfer)
    "query_head.match",  # the query heads' Hungarian matching runs on the host
}


def _host_round_trips_case(name, layout):
    torch.manual_seed(0)
    model = DETECTORS[name].tiny()
    batch = surround_batch(batch=2, cameras=2, height=64, width=96, boxes=[3, 1])
    batch["images"] = shard(batch["images"], axes(layout))

    def step():
        model.loss(model(batch), batch)["loss"].backward()

    with entered(Run(bev_shard="x" if layout == "w2" else "xy", fallback="error")):
        step()  # first calls may plan and cache (index tensors are built once)
        with HostRoundTrips() as host:
            step()
    found = waits(host.made, HOST_BY_DESIGN)
    assert not found, f"(function, op) {found} wait for the device in every training step"


@pytest.mark.parametrize("layout", ["w2", "2x2"])
@pytest.mark.parametrize("name", list(DETECTORS))
def test_a_training_step_never_waits_for_the_device(name, layout):
    """Forward, loss and backward of each BEV detector, sharded, copy nothing between host and device (on a GPU each
    copy drains its queue, and the GPU idles while Python launches what follows) except where ``HOST_BY_DESIGN``
    says: the last step of a rank with the default CUDA graphs is then never waiting on the host's Python."""
    run_spmd(_host_round_trips_case, 2 if layout == "w2" else 4, name, layout)
