#!/usr/bin/env bash
# The benchmark grid of docs/benchmarks.md on one GPU (fake backend), in parts that fit one device call each.
#   bash recipes/bench_h200.sh 1   # fp32: S=2 width, 2-D tiles, narrower images
#   bash recipes/bench_h200.sh 2   # bf16, activation checkpointing, 6x3x720x1280, fake-backend p2p cost
#   bash recipes/bench_h200.sh 3   # the single-GPU full image, plain and with gradient checkpointing
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(cd "$(dirname "$0")/.." && pwd)"
B="python3 $(dirname "$0")/benchmark.py --out ${OUT:-.}"
case "${1:-1}" in
  1) $B --widths 4096 --spatial 2,4,8 --layouts width
     $B --widths 4096 --spatial 4,8 --layouts tiles
     $B --widths 1024,2048 --spatial 4 --layouts width ;;
  2) $B --widths 4096 --spatial 4,8 --layouts width --precisions bf16
     $B --widths 4096 --spatial 4 --layouts width --ckpt 1
     $B --batch 6 --height 720 --widths 1280 --spatial 2,4 --layouts width
     $B --widths 4096 --spatial 8 --layouts width --precisions bf16 --fake-p2p backend ;;
  3) $B --widths 4096 --spatial 1 --ckpt 0,1 --steps 2 --warmup 1 ;;
esac
