"""The split-gradient convention as users meet it: gradients w.r.t. sharded inputs are exact and sharded,
and the weights match one device under manual optimization and under a user's DDP comm hook."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_spatial import SpatialParallelStrategy, SpatialTensor, gather
from tests.oracle import assert_rel_close
from tests.strategy.lit import Images, LitModel, loader
from tests.strategy.test_equivalence import assert_same_weights
from tests.strategy.test_strategy import trainer


class Saliency(LitModel):
    """Takes the gradient of the loss w.r.t. the sharded input two ways; checks both in the rank."""

    def __init__(self):
        super().__init__("segnet")

    def training_step(self, batch, batch_idx):
        self.batch = batch
        x = batch["image"].requires_grad_()
        loss = F.cross_entropy(self(x), batch["mask"])
        (self.direct,) = torch.autograd.grad(loss, x, retain_graph=True)
        return loss

    def on_after_backward(self):  # before the optimizer step: the weights are those of the forward
        full = gather(self.batch["image"]).detach().requires_grad_()
        loss = F.cross_entropy(copy.deepcopy(self.model)(full), gather(self.batch["mask"]))
        (expected,) = torch.autograd.grad(loss, full)
        for how, got in (("x.grad", self.batch["image"].grad), ("torch.autograd.grad", self.direct)):
            assert isinstance(got, SpatialTensor), (how, type(got))
            assert_rel_close(gather(got), expected, how)


def test_gradient_of_a_sharded_input_is_exact_and_sharded():
    """2x2 tiles (S = 4): a loss seeded with 1 on every rank would give 4x the gradient."""
    trainer(4, (2, 2), max_epochs=1).fit(Saliency(), loader(Images(4, 16, 24), 2))


class Manual(LitModel):
    def __init__(self):
        super().__init__("segnet")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss, _ = self._loss(batch)
        self.manual_backward(loss)
        optimizer.step()


def test_manual_optimization_matches_single_device():
    data = Images(4, 16, 24)
    reference, ours = Manual(), Manual()
    trainer(spatial=None).fit(reference, loader(data, 2))
    trainer(2, 2, use_distributed_sampler=False).fit(ours, loader(data, 2))
    assert_same_weights(ours, reference)


@pytest.mark.parametrize(
    "hook,tolerance",
    [
        (default_hooks.allreduce_hook, 1e-4),  # the world average, scaled to the data-parallel mean: exact
        (default_hooks.fp16_compress_hook, 2e-3),  # gradients rounded to fp16 every step: measured 2.9e-4
    ],
)
def test_a_user_comm_hook_composes_with_the_split_gradients(hook, tolerance):
    data = Images(4, 16, 24)
    reference, ours = LitModel("segnet"), LitModel("segnet")
    trainer(spatial=None).fit(reference, loader(data, 2))
    strategy = SpatialParallelStrategy(2, start_method="fork", ddp_comm_hook=hook)
    trainer(2, 2, strategy=strategy, use_distributed_sampler=False).fit(ours, loader(data, 2))
    assert_same_weights(ours, reference, tolerance)
