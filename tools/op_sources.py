"""Which lines issue the ops of a training step: a rank's ops against its baseline's, counted by where they came from.

    python tools/op_sources.py --out DIR -- [benchmarks/trainer_step.py's arguments]

runs ``benchmarks/trainer_step.py`` and, for the first timed step of each fit (the baseline's, then the rank's),
counts every aten op by its source: the innermost two frames of timm, a model or lightning_spatial that called it,
or, in backward, the autograd node running it (``ConvolutionBackward0``: torch's own derivative). It writes
``DIR/op_sources.json`` and prints each op's count in both fits, the ops the rank adds first. On a GPU each op is a
kernel or a few (a small one costs its launch whatever its size), and a replayed CUDA graph holds the same kernels
without naming the lines that launched them: run with ``--cuda-graphs off`` there, or on CPU (where nothing is
captured) with toy sizes.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback

MODEL_CODE = ("timm/", "lightning_spatial/", "/models/")  # frames that name a source (the strategy's are not)
RUNNER = ("torch/optim/", "torch/nn/parallel/")  # the optimizer's step, DDP's forward: named where nothing else is


def source(stack: list[traceback.FrameSummary], node: str | None) -> str:
    """Where an op came from: the innermost two frames of timm, a model or lightning_spatial (the strategy's left
    out); else, in backward, the autograd node running it (torch's own derivative) or ``autograd hooks`` (DDP's
    reducer); else the innermost frame of the optimizer or DDP, or outside torch's private modules."""
    code = [f for f in reversed(stack) if any(p in f.filename for p in MODEL_CODE) and "strategies/" not in f.filename]
    if code:
        return " < ".join(_short(f) for f in code[:2])
    if node:
        return f"autograd {node}"
    if any(f.name == "_engine_run_backward" for f in stack):
        return "autograd hooks"
    runner = [f for f in reversed(stack) if any(p in f.filename for p in RUNNER)]
    public = runner or [f for f in reversed(stack) if "torch/_" not in f.filename and "torch/utils/_" not in f.filename]
    return _short(public[0]) if public else "?"


def _short(frame: traceback.FrameSummary) -> str:
    path = frame.filename.split("site-packages/")[-1].split("lightning_spatial/")[-1]
    return f"{path}:{frame.lineno} {frame.name}"


def counted():
    """A dispatch mode counting each aten op by (op, source)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            node = torch._C._current_autograd_node()
            self.counts[
                (func.overloadpacket.__name__, source(traceback.extract_stack()[:-1], node and node.name()))
            ] += 1
            return func(*args, **(kwargs or {}))

    return Counting()


def summary(fits: list[dict]) -> str:
    """Each op's count per fit; the ops the last fit adds over the first come first."""
    per_op = [collections.Counter() for _ in fits]
    for counter, fit in zip(per_op, fits):
        for key, n in fit["sources"].items():
            counter[key.split(" @ ")[0]] += n
    ops = sorted(set().union(*per_op), key=lambda op: per_op[0][op] - per_op[-1][op])
    lines = ["  ".join(f"{fit['fit']:>8}" for fit in fits) + "  op"]
    lines += ["  ".join(f"{c[op]:8d}" for c in per_op) + f"  {op}" for op in ops]
    return "\n".join(lines)


def main() -> None:
    from wrapped_step import fit_name, trainer_step_from_cli

    out, trainer_step = trainer_step_from_cli(__doc__)
    fits, fit = [], {}
    measure = trainer_step.measure

    def measured(step_args, plugins):
        fit["name"] = fit_name(step_args)
        return measure(step_args, plugins)

    class CountingTimer(trainer_step.StepTimer):
        """The benchmark's timer, counting the ops of the first timed step."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            if batch_idx == self.warmup and trainer.local_rank == 0:
                self.counting = counted()
                self.counting.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == self.warmup and trainer.local_rank == 0:
                self.counting.__exit__(None, None, None)
                sources = {f"{op} @ {where}": n for (op, where), n in self.counting.counts.most_common()}
                fits.append({"fit": fit["name"], "ops": sum(sources.values()), "sources": sources})
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    trainer_step.StepTimer, trainer_step.measure = CountingTimer, measured
    trainer_step.main()
    with open(os.path.join(out, "op_sources.json"), "w") as f:
        json.dump({"args": sys.argv[1:], "fits": fits}, f, indent=1)
    print(summary(fits), flush=True)


if __name__ == "__main__":
    main()
