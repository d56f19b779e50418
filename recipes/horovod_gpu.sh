#!/usr/bin/env bash
# Horovod on GPUs (the device tool's nvidia-h200-x2: 2 GPUs, no network): build it with NCCL offline from the
# files in .whl (python -m lightning_spatial.install_horovod --download .whl fetches them), run the GPU tests,
# then time Horovod against DDP on the same 2 GPUs, same model and per-GPU batch.
#   bash recipes/horovod_gpu.sh            # rows appended to $OUT/bench_trainer.jsonl, logs in $OUT/runs.log
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(cd "$(dirname "$0")/.." && pwd)"
OUT=${OUT:-.}
BIN=$(dirname "$(command -v python3)")
python3 -m pip install -q --no-index --find-links "${WHEELS:-.whl}" hydra-core omegaconf
if ! python3 -m lightning_spatial.install_horovod --from "${WHEELS:-.whl}" > "$OUT/horovod_build.log" 2>&1; then
  grep -n "error" "$OUT/horovod_build.log" | head -20; tail -5 "$OUT/horovod_build.log"; exit 1
fi
tail -1 "$OUT/horovod_build.log"
python3 -m pytest -q -p no:cacheprovider tests/horovod -k "gpu" -rs 2>&1 | tail -15
B="recipes/bench_trainer.py --out $OUT --steps ${STEPS:-8} --warmup 2"
for precision in 32-true bf16-mixed; do
  for model in "convnext_large --batch 4 --height 512 --width 1024" "petr --batch 1 --height 512 --width 1408"; do
    "$BIN/horovodrun" -np 2 -H localhost:2 python3 $B --strategy horovod --model $model --precision $precision \
      >> "$OUT/runs.log" 2>&1 || echo "FAILED: horovod $model $precision"
    "$BIN/torchrun" --standalone --nproc-per-node 2 $B --strategy ddp --model $model --precision $precision \
      >> "$OUT/runs.log" 2>&1 || echo "FAILED: ddp $model $precision"
  done
done
python3 - "$OUT/bench_trainer.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    print(f"{r['strategy']:8} {r['model']:15} {r['precision']:11} batch/GPU {r['batch']}  {r['step_ms']:8.1f} ms  "
          f"{r['peak_gib_rank0']:6.2f} GiB  {r['device']} torch {r['torch']}")
PY
