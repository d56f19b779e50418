"""The benchmark as a Hydra multirun: each job measures one configuration (benchmarks/spatial_step.py's
``run_config``) and appends its row to one CSV; when the sweep ends, benchmarks/plot_rows.py plots it.

python benchmarks/sweep.py -m spatial=1,2,4,8                      # one GPU, fake process group
python benchmarks/sweep.py -m device=cpu backbone=convnext_atto batch=1 height=64 width=256 spatial=1,2 \\
    steps=1 warmup=0                                                   # CPU smoke run
Under torchrun every job measures its rank of a real group (spatial must equal the world size).
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
from pathlib import Path

import hydra
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from spatial_step import run_config, setup


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    options = OmegaConf.to_container(cfg, resolve=True)
    args = argparse.Namespace(model=options.pop("backbone"), **options)
    device, real = setup(args)
    row = run_config(args, device, args.width, args.spatial, args.layout, args.precision, args.ckpt, real)
    if not real or dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
        append_row(Path(args.csv), row)
    return row


def append_row(path: Path, row: dict) -> None:
    """Append under a file lock (parallel launchers); the first row writes the header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", newline="") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        header = next(csv.reader(f), None)
        writer = csv.DictWriter(f, header or list(row), extrasaction="ignore")
        if header is None:
            writer.writeheader()
        writer.writerow(row)


if __name__ == "__main__":
    main()
