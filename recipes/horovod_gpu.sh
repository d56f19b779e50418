#!/usr/bin/env bash
# Horovod on GPUs (the device tool's nvidia-h200-x2: 2 GPUs, no network): build it with NCCL offline from the
# files in .whl (python -m lightning_spatial.install_horovod --download .whl fetches them), run the GPU tests,
# then time Horovod against DDP on the same 2 GPUs, same model and per-GPU batch.
#   bash recipes/horovod_gpu.sh            # rows appended to $OUT/bench_trainer.jsonl, logs in $OUT/runs.log
#   bash recipes/horovod_gpu.sh build      # only the build (a warm machine keeps it for the next call)
#   bash recipes/horovod_gpu.sh bf16       # bf16 only: DDP, Horovod, Horovod with async_completion
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(cd "$(dirname "$0")/.." && pwd)"
OUT=${OUT:-.}
BIN=$(dirname "$(command -v python3)")
python3 -m pip install -q --no-index --find-links "${WHEELS:-.whl}" hydra-core omegaconf
if ! python3 -c "import horovod.torch" 2>/dev/null; then
  if ! python3 -m lightning_spatial.install_horovod --from "${WHEELS:-.whl}" > "$OUT/horovod_build.log" 2>&1; then
    grep -n "error" "$OUT/horovod_build.log" | head -20; tail -5 "$OUT/horovod_build.log"; exit 1
  fi
  tail -1 "$OUT/horovod_build.log"
fi
B="recipes/bench_trainer.py --out $OUT --steps ${STEPS:-8} --warmup 2"
MODELS=("convnext_large --batch 4 --height 512 --width 1024" "petr --batch 1 --height 512 --width 1408")
compare() {  # precision, then the Horovod variants: each a quoted list of bench_trainer options
  local precision=$1 model variant; shift
  for model in "${MODELS[@]}"; do
    "$BIN/torchrun" --standalone --nproc-per-node 2 $B --strategy ddp --model $model --precision $precision \
      >> "$OUT/runs.log" 2>&1 || echo "FAILED: ddp $model $precision"
    for variant in "$@"; do
      "$BIN/horovodrun" -np 2 -H localhost:2 python3 $B --strategy horovod --model $model --precision $precision \
        $variant >> "$OUT/runs.log" 2>&1 || echo "FAILED: horovod $model $precision $variant"
    done
  done
}
[ "${1:-all}" = build ] && exit 0
python3 -m pytest -q -p no:cacheprovider tests/horovod -k "gpu" -rs 2>&1 | tail -15
case "${1:-all}" in
  bf16) compare bf16-mixed "" "--async-completion" ;;
  *) compare 32-true ""; compare bf16-mixed "" ;;
esac
python3 - "$OUT/bench_trainer.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    knobs = " async" if r.get("async_completion") else ""
    print(f"{r['strategy'] + knobs:14} {r['model']:15} {r['precision']:11} batch/GPU {r['batch']}  {r['step_ms']:8.1f} ms"
          f"  {r['peak_gib_rank0']:6.2f} GiB  {r['device']} torch {r['torch']}")
PY
