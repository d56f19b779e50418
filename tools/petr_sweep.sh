#!/usr/bin/env bash
# Variants of the tiny PETR (experiment=bev_cpu, one device each) side by side for $MINUTES minutes: which of them
# learn, given far more steps than a CPU run has (docs/bev.md). On 2 GPUs:
#   GPUS=2 MINUTES=7 bash tools/petr_sweep.sh tools/petr_sweep.txt    # one line per variant: name overrides...
# Each run's log and metrics.csv go to $OUT/sweep.tgz; the summary prints val_mAP at every validation.
# CPU smoke: DEV=cpu ACC=cpu EXTRA="+trainer.max_steps=2" bash tools/petr_sweep.sh variants.txt
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)" OMP_NUM_THREADS=2
OUT=${OUT:-.} RUNS=${RUNS:-/tmp/petr_sweep} DEV=${DEV:-cuda:0} ACC=${ACC:-gpu}
python3 -m pip install -q --no-index --no-deps --find-links "${WHEELS:-.whl}" hydra-core omegaconf antlr4-python3-runtime torchdata pyyaml 2>/dev/null
common="experiment=bev_cpu strategy=single strategy.device=$DEV ~strategy.spatial_size trainer.accelerator=$ACC
  trainer.devices=1 trainer.max_epochs=100000 ++trainer.max_time=00:00:$(printf %02d "${MINUTES:-7}"):00
  ++trainer.check_val_every_n_epoch=${VAL_EVERY:-5} trainer.enable_progress_bar=false trainer.log_every_n_steps=20
  data.num_workers=2 ${EXTRA:-}"
i=0 pids=() names=() failed=0
mkdir -p "$RUNS"
while read -r name args; do
  case "$name" in ""|\#*) continue ;; esac
  CUDA_VISIBLE_DEVICES=$((i % ${GPUS:-1})) python3 "$PYTHONPATH/recipes/train.py" $common $args out="$RUNS/$name" \
    hydra.run.dir="$RUNS/$name" > "$RUNS.$name.log" 2>&1 &
  pids+=($!) names+=("$name") i=$((i + 1))
done < "$1"
for k in "${!pids[@]}"; do
  wait "${pids[$k]}" || { failed=1; echo "FAILED: ${names[$k]}"; tail -5 "$RUNS.${names[$k]}.log"; }
done
tar czf "$OUT/sweep.tgz" --exclude=checkpoints --exclude=tensorboard -C "$(dirname "$RUNS")" "$(basename "$RUNS")" \
  $(cd "$(dirname "$RUNS")" && ls "$(basename "$RUNS")".*.log)
python3 - "$RUNS" <<'PY'
import csv, pathlib, sys
for metrics in sorted(pathlib.Path(sys.argv[1]).glob("*/csv/metrics.csv")):
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("val_mAP")]
    print(f"{metrics.parts[-3]:20}", " ".join(f"{r['step']}:{float(r['val_mAP']):.3f}" for r in rows))
PY
exit $failed
