import socket

import pytest
import torch

# Forked ranks must not inherit a busy intra-op thread pool; tiny tensors need no threads anyway.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_master_port(monkeypatch):
    """Each Trainer-level test rendezvous on its own free port (Lightning reuses MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


@pytest.fixture(autouse=True)
def _environment_restored():
    """What a test puts into the environment (``seed_everything``'s PL_GLOBAL_SEED, a launcher's ranks) ends with it:
    a later test's Trainer would read it (Lightning seeds its distributed sampler from PL_GLOBAL_SEED)."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
