"""Run under horovodrun by tests/horovod/test_horovod.py: validate on sets 2 replicas do not divide evenly."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_spatial  # noqa: E402
from tests.strategy.lit import loader  # noqa: E402
from tests.strategy.test_data_axis import Indexed  # noqa: E402
from tests.strategy.test_each_sample_once import SAMPLES, Scored, informed_and_scenes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name, (model, data) in {
        "segnet": (Scored(), loader(Indexed(SAMPLES, 16, 24), 1)),
        "petr": informed_and_scenes(),
    }.items():
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=lightning_spatial.HorovodStrategy(),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        results[name] = trainer.validate(model, data, verbose=False)[0]
    if trainer.global_rank == 0:
        Path(args.out, "validated.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
