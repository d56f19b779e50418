"""A run's state belongs to the run: nested runs do not see each other's fallback mode, announcements, module
names or halo counters, and leaving a run restores the one before."""

from __future__ import annotations

import warnings

import pytest
import torch

import lightning_spatial
from lightning_spatial import LayoutError, SpatialFallbackWarning, fallback_mode
from lightning_spatial.primitives import counting_halo_bytes
from lightning_spatial.run import Run, current, entered
from tests.spmd import axes, run_spmd


class Roll(torch.nn.Module):
    def forward(self, x):
        return torch.roll(x, 1, -1)  # no spatial handler: the fallback


def _nested_case():
    x = lightning_spatial.shard(torch.randn(1, 2, 4, 8), axes("w2"))
    roll = Roll()
    outer = current()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with entered(Run(module_names={id(roll): "head.roll"})) as first:
            roll(x)
            roll(x)  # announced once per op and layer in a run
            with entered(Run(fallback="error")) as second:
                assert current() is second and second.module_names == {}
                with pytest.raises(LayoutError, match=r"torch.roll has no spatial handler"):
                    roll(x)  # the inner run names no module and raises
            assert current() is first and first.fallback == "warn"
        with entered(Run()):
            roll(x)  # a new run announces again
    assert current() is outer and not outer.warned
    messages = [str(w.message) for w in caught if w.category is SpatialFallbackWarning]
    assert len(messages) == 2 and "in module 'head.roll' (Roll)" in messages[0] and "in module" not in messages[1]


def test_nested_runs_keep_their_own_fallback_state():
    run_spmd(_nested_case, 2)


def _halo_case():
    x = lightning_spatial.shard(torch.randn(1, 2, 4, 8), axes("w2"))
    weight = torch.randn(2, 2, 3, 3)
    with counting_halo_bytes() as outer:
        torch.nn.functional.conv2d(x, weight, padding=1)
        with entered(Run()), counting_halo_bytes() as inner:
            torch.nn.functional.conv2d(x, weight, padding=1)
    row = 1 * 2 * 4 * 4  # one column of (1, 2, 4) float32 values to the neighbour
    assert inner.sent == row and outer.sent == 2 * row, (inner, outer)


def test_halo_bytes_are_counted_in_the_block_that_asks():
    run_spmd(_halo_case, 2)


def test_fallback_mode_names_the_modes():
    with pytest.raises(ValueError, match="fallback must be 'warn', 'error' or 'silent', got 'loud'"):
        with fallback_mode("loud"):
            pass
    with pytest.raises(ValueError, match="got 'loud'"):
        Run(fallback="loud")


def _mask_rows_case():
    x, y = (lightning_spatial.shard(torch.randn(1, 2, 4, 8), axes("w2")) for _ in range(2))
    mask = lightning_spatial.shard(torch.rand(1, 2, 4, 8) > 0.5, axes("w2"))
    outer = current()
    with entered(Run()) as first:
        x[mask], y[mask]  # the second selection reuses the rows the first counted
        (rows,) = first.index_rows[mask].values()
        with entered(Run()) as second:
            x[mask]
            assert (
                second.index_rows[mask].keys() == first.index_rows[mask].keys()
                and rows not in second.index_rows[mask].values()
            )
    assert mask not in outer.index_rows


def test_the_rows_of_a_mask_are_kept_by_the_run():
    run_spmd(_mask_rows_case, 2)
