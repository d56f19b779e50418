"""Where a rank's GPU time goes against its baseline: two op lists of ``benchmarks/trainer_step.py --profile``
(the rank's and the baseline's, the same run), their kernels' device time summed by kind, the baseline's divided by
``--per`` (S: against one device's whole input, ideal scaling is 1/S of it), and the kernels that differ most.

    python tools/profile_diff.py profile_spatial_tp_petr_bf16-mixed_1315.txt profile_single_petr_bf16-mixed_1315.txt \
        --per 4
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# a kernel's kind, by the first pattern its name matches (profiler rows of host ops are left out)
KINDS = (
    ("attention", r"fmha|sdpa|flash|attention"),
    ("gemm", r"gemm|nvjet|splitK"),
    ("convolution", r"conv|wgrad|dgrad|fprop|implicit|cudnn"),
    ("copy, fill", r"copy|Memcpy|CatArray|Fill|Memset"),
    ("optimizer", r"multi_tensor"),
    ("index, scatter", r"index|scatter|grid_sampler"),
    ("reduce, norm", r"reduce|norm|Norm"),
    ("elementwise, other", r""),
)
# host rows (ops, autograd nodes, runtime calls), whose device time repeats their kernels' (``_Z``: a mangled kernel)
HOST = re.compile(
    r"^(aten::|autograd::|torch::|lightning_spatial::|c10d::|nccl:|Optimizer|Distributed|ProfilerStep|record_param"
    r"|\[pl\]|cuda[A-Z]|_(?!Z)[A-Z]|[A-Z]\w*Backward\d*$)"
)


def kernels(path: str) -> dict[str, tuple[float, int]]:
    """Kernel name -> (device time in us, calls), from the "every op" list at the end of a profile file."""
    listed = Path(path).read_text().split("every op, device time (us), calls\n", 1)[1]
    rows = (json.loads(line) for line in listed.splitlines() if line)
    return {name: (us, calls) for name, us, calls in rows if us > 0 and not HOST.match(name)}


def kind(name: str) -> str:
    return next(k for k, pattern in KINDS if re.search(pattern, name))


def by_kind(table: dict[str, tuple[float, int]], per: float = 1.0) -> dict[str, float]:
    """Milliseconds per kind, divided by ``per``."""
    out = dict.fromkeys((k for k, _ in KINDS), 0.0)
    for name, (us, _) in table.items():
        out[kind(name)] += us / 1e3 / per
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rank", help="the rank's profile file")
    p.add_argument("baseline", help="the baseline's profile file, from the same run")
    p.add_argument("--per", type=float, default=1.0, help="divide the baseline by this (S, for a one-device baseline)")
    p.add_argument("--top", type=int, default=12, help="kernels listed by their difference")
    args = p.parse_args()
    ours, base = kernels(args.rank), kernels(args.baseline)
    a, b = by_kind(ours), by_kind(base, args.per)
    print(f"{'kind':20s} {'baseline/' + format(args.per, 'g'):>12s} {'rank':>9s}  (ms of kernel time)")
    for k in a:
        print(f"{k:20s} {b[k]:12.2f} {a[k]:9.2f}")
    print(f"{'all kernels':20s} {sum(b.values()):12.2f} {sum(a.values()):9.2f}")

    def gap(name: str) -> float:
        return ours.get(name, (0, 0))[0] - base.get(name, (0, 0))[0] / args.per

    print(f"\n{'rank - baseline (us)':>20s} {'calls':>11s}  kernel")
    for name in sorted(set(ours) | set(base), key=lambda n: -abs(gap(n)))[: args.top]:
        calls = f"{ours.get(name, (0, 0))[1]} / {base.get(name, (0, 0))[1]}"
        print(f"{gap(name):20.0f} {calls:>11s}  {name[:100]}")


if __name__ == "__main__":
    main()
