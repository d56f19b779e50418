"""The multi-process harness itself: ranks are forked, or spawned once this process has used CUDA (a GPU test
earlier in the same run), where a forked rank could not run a Trainer (tests/spmd.py)."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

from tests.spmd import run_spmd

_SET_IN_THE_PARENT = False


def _a_fresh_interpreter_per_rank():
    assert not _SET_IN_THE_PARENT, "this rank was forked: it inherited the parent's state"
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    assert total.item() == 3.0


@pytest.mark.slow
def test_ranks_are_spawned_once_this_process_used_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(sys.modules[__name__], "_SET_IN_THE_PARENT", True)
    run_spmd(_a_fresh_interpreter_per_rank, 2)


def _rank_1_crashes():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGFPE)  # as a kernel's integer division by zero does
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_reported_not_waited_for():
    with pytest.raises(AssertionError, match="rank 1 died: signal SIGFPE"):
        run_spmd(_rank_1_crashes, 2, timeout=600)
