#!/usr/bin/env bash
# Horovod on a machine of 2 GPUs without network access: build it with NCCL offline from the
# files in .whl (python -m lightning_spatial.install_horovod --download .whl fetches them), run the GPU tests,
# then time Horovod against DDP on the same 2 GPUs, same model and per-GPU batch.
#   bash tools/horovod_gpu.sh            # rows appended to $OUT/bench_trainer.jsonl, logs in $OUT/runs.log
#   bash tools/horovod_gpu.sh build      # only the build (a warm machine keeps it for the next call)
#   bash tools/horovod_gpu.sh bf16       # bf16 only: DDP; Horovod as is, and with gradients in 25 MiB buckets
#                                        # (one grouped all-reduce each, as DDP's), also with async completion
#   REPEATS=3 STEPS=20 bash tools/horovod_gpu.sh bf16   # interleaved repeats: one run's median varies ~10%
#   TESTS=0 ONLY=petr REPEATS=3 STEPS=20 bash tools/horovod_gpu.sh bf16   # one model (petr or convnext_large)
#   PROFILE=1 ...                        # also rank 0's profile of its first timed step, per run (profile_*.txt)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(cd "$(dirname "$0")/.." && pwd)"
OUT=${OUT:-.}
BIN=$(dirname "$(command -v python3)")
python3 -m pip install -q --no-index --no-deps --find-links "${WHEELS:-.whl}" hydra-core omegaconf antlr4-python3-runtime torchdata pyyaml
if ! python3 -c "import horovod.torch" 2>/dev/null; then
  if ! python3 -m lightning_spatial.install_horovod --from "${WHEELS:-.whl}" > "$OUT/horovod_build.log" 2>&1; then
    grep -n "error" "$OUT/horovod_build.log" | head -20; tail -5 "$OUT/horovod_build.log"; exit 1
  fi
  tail -1 "$OUT/horovod_build.log"
fi
B="benchmarks/trainer_step.py --out $OUT --steps ${STEPS:-8} --warmup 2 ${PROFILE:+--profile}"
MODELS=()
for model in "convnext_large --batch 4 --height 512 --width 1024" "petr --batch 1 --height 512 --width 1408"; do
  [[ -z "${ONLY:-}" || $model == "$ONLY "* ]] && MODELS+=("$model")
done
compare() {  # precision, then the Horovod variants: each a quoted list of trainer_step.py options
  local precision=$1 model variant rep; shift
  for rep in $(seq "${REPEATS:-1}"); do for model in "${MODELS[@]}"; do  # repeats interleave: runs vary by ~10%
    "$BIN/torchrun" --standalone --nproc-per-node 2 $B --strategy ddp --model $model --precision $precision \
      >> "$OUT/runs.log" 2>&1 || echo "FAILED: ddp $model $precision"
    for variant in "$@"; do  # trainer_step.py options, and KEY=VALUE words set in Horovod's environment
      local envs=() opts=() word
      for word in $variant; do if [[ $word == *=* ]]; then envs+=("$word"); else opts+=("$word"); fi; done
      env "${envs[@]}" "$BIN/horovodrun" -np 2 -H localhost:2 python3 $B --strategy horovod --model $model \
        --precision $precision "${opts[@]}" >> "$OUT/runs.log" 2>&1 || echo "FAILED: horovod $model $precision $variant"
    done
  done; done
}
[ "${1:-all}" = build ] && exit 0
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/horovod -k "gpu" -rs 2>&1 | tail -15
case "${1:-all}" in
  # profiled: a 1 ms cycle sends PETR's gradients in ~100 small pieces (DDP: 19 buckets); a 5 ms cycle was slower
  # still. A variant word KEY=VALUE (OMP_NUM_THREADS=1, say) goes into Horovod's environment
  bf16) compare bf16-mixed "" "--bucket-mb 25" "--bucket-mb 25 --async-completion" ;;
  *) compare 32-true ""; compare bf16-mixed "" ;;
esac
python3 - "$OUT/bench_trainer.jsonl" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(list)  # the median over repeated runs, and its ratio to DDP's on the same model
for r in map(json.loads, open(sys.argv[1])):
    knobs = "".join(f" {k}={r[k]}" for k in ("async_completion", "cycle_ms", "bucket_mb", "compression") if r.get(k) not in (None, False, "none"))
    knobs += f" threads={r['threads']}" if r.get("threads", 1) != 1 else ""
    runs[r["model"], r["precision"], r["strategy"] + knobs].append(r["step_ms"])
for (model, precision, name), times in runs.items():
    ddp = statistics.median(runs.get((model, precision, "ddp"), [float("nan")]))
    print(f"{name:30} {model:15} {precision:11} {statistics.median(times):7.1f} ms (runs: {len(times)}, "
          f"{min(times):.1f}-{max(times):.1f})  {statistics.median(times) / ddp:.3f}x DDP")
PY
