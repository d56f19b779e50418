"""What the tools that wrap ``benchmarks/trainer_step.py`` share: their command line and each fit's name."""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType


def trainer_step_from_cli(description: str) -> tuple[str, ModuleType]:
    """Parse ``--out DIR -- [trainer_step.py's arguments]``, hand those arguments (and ``--out DIR``) to
    ``trainer_step`` as its command line and import it: (DIR, the module), for the tool to wrap before its ``main``."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("step", nargs=argparse.REMAINDER, help="-- and benchmarks/trainer_step.py's arguments")
    args = p.parse_args()
    sys.argv = ["trainer_step.py", *[a for a in args.step if a != "--"], "--out", args.out]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import trainer_step

    return args.out, trainer_step


def fit_name(step_args: argparse.Namespace) -> str:
    """``baseline`` for the plain model's fit, ``rank`` for the strategy's."""
    return "baseline" if step_args.strategy == "single" else "rank"
