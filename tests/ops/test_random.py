"""Dropout, DropPath and random tensors: the single-device decisions, and identical weights after training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.layers import DropPath

from lightning_spatial import shard
from tests.oracle import assert_rel_close, check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)


def _seeded(op):
    def run(x):
        torch.manual_seed(21)  # the same stream for the reference and the sharded call
        return op(x)

    return run


OPS = {
    "dropout": lambda x: F.dropout(x, 0.3, training=True),
    "dropout2d": lambda x: F.dropout2d(x, 0.5, training=True),
    "drop_path": DropPath(0.4),
    "eval_dropout": lambda x: F.dropout(x, 0.3, training=False),
    "dropout2d_p1": lambda x: F.dropout2d(x, 1.0, training=True),  # zeros, not 0/0
    "rand_like": lambda x: x * torch.rand_like(x),  # global draws, this rank's part: no gather, no repetition
    "randn_like": lambda x: x + torch.randn_like(x, dtype=torch.float64),
    "randint_like": lambda x: x * torch.randint_like(x, 0, 5),
    "normal_": lambda x: x * torch.empty_like(x).normal_(1.0, 0.5),
    "uniform_": lambda x: x * torch.empty_like(x).uniform_(-1, 1),
    "bernoulli_": lambda x: x * torch.empty_like(x).bernoulli_(0.3),
}


def _case(layout, name):
    torch.manual_seed(14)
    check(_seeded(OPS[name]), [torch.randn(4, 3, 5, 17 if layout == "w3" else 8)], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("name", list(OPS))
def test_random_ops_match_one_device(layout, name):
    run_spmd(_case, LAYOUTS[layout][0], layout, name)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.body = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.drop_path = DropPath(0.3)
        self.dense = torch.nn.Conv2d(8, 2, 1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.norm(self.stem(x)))
        x = x + self.drop_path(F.dropout2d(self.body(x), 0.2, self.training))
        x = F.dropout(x, 0.1, self.training)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1)), self.dense(x)


def _train(model, images, targets, steps, spatial_size):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        torch.manual_seed(100 + step)  # every rank draws the same stream, as one device would
        logits, dense = model(images)
        loss = F.cross_entropy(logits, targets) + F.mse_loss(dense, torch.zeros_like(dense))
        (loss / spatial_size).backward()  # the split-gradient convention; the strategy does this
        if spatial_size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()


def _training_case(layout):
    torch.manual_seed(15)
    reference = _Net()
    ours = _Net()
    ours.load_state_dict(reference.state_dict())
    images, targets = torch.randn(4, 3, 12, 26 if layout == "w3" else 16), torch.randint(0, 5, (4,))
    _train(reference, images, targets, 3, 1)
    _train(ours, shard(images, axes(layout)), targets, 3, dist.get_world_size())
    for (name, expected), actual in zip(reference.state_dict().items(), ours.state_dict().values()):
        assert_rel_close(actual, expected, f"{name} after 3 steps")
        same = actual.clone()
        dist.broadcast(same, 0)
        assert torch.equal(same, actual), f"{name} differs between ranks"


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_training_with_dropout_keeps_weights_identical_and_exact(layout):
    run_spmd(_training_case, LAYOUTS[layout][0], layout)
