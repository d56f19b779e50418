"""``EpochShuffle`` and ``resumable_loader`` without a Trainer: the order is a function of (seed, epoch), and a
state saved inside an epoch resumes on that epoch's remaining samples (main process and workers)."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from lightning_spatial.data import EpochShuffle, resumable_loader

DATA = list(range(10))


def test_the_order_is_distributed_samplers_for_one_replica():
    """One device and one data replica of a spatial group (Lightning's ``DistributedSampler``) see the same order."""
    ours, lightnings = EpochShuffle(DATA, seed=5), DistributedSampler(DATA, 1, 0, shuffle=True, seed=5)
    for epoch in (0, 3):
        ours.set_epoch(epoch)
        lightnings.set_epoch(epoch)
        assert list(ours) == list(lightnings)
    assert list(ours) != DATA


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_inside_an_epoch_resumes_on_its_remaining_samples(workers):
    def loader():
        made = resumable_loader(DATA, batch_size=2, shuffle=True, num_workers=workers)
        made.sampler.set_epoch(1)
        return made

    uninterrupted = [batch.tolist() for batch in loader()]
    first = loader()
    batches = iter(first)
    seen = [next(batches).tolist() for _ in range(2)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert seen + [batch.tolist() for batch in resumed] == uninterrupted
    resumed.sampler.set_epoch(2)  # the next epoch starts from its own first sample
    assert sorted(i for batch in resumed for i in batch.tolist()) == DATA


def test_a_restored_state_applies_to_its_own_epoch_only():
    sampler = EpochShuffle(DATA, seed=0)
    sampler.load_state_dict({"epoch": 4, "yielded": 6})
    assert len(list(sampler)) == 4  # epoch 4's last 4 samples
    sampler.load_state_dict({"epoch": 4, "yielded": 10})  # saved as epoch 4 ended
    sampler.set_epoch(5)
    assert sorted(sampler) == DATA
