#!/usr/bin/env bash
# BEV on H200s (docs/benchmarks.md, docs/bev.md): the camera-token attention and PETR memory, then PETR training.
#   bash tools/bev_h200.sh memory     # one GPU (fake group for S>1) and 2 GPUs over NCCL: rows to $OUT
#   bash tools/bev_h200.sh bevformer  # BEVFormer-base-like at 900x1600, 200x200 BEV, S = 1..8 (one GPU, fake group)
#   bash tools/bev_h200.sh bevplane   # Lift-Splat and Simple-BEV (ResNet BEV encoder) at 6x512x1408, 200x200 BEV,
#                                       # S = 2, 4, 8, BEV replicated and sharded (one GPU, fake group)
#   bash tools/bev_h200.sh trainer    # ${MODELS:-bevformer lift_splat simple_bev} (or petr) through the Trainer as
#                                       # users run them (default CUDA graphs, bev_shard="x"), one rank of each S in
#                                       # ${S:-4} ("4 8": both; fake group) beside one device, ${PRECISION:-32-true};
#                                       # EXTRA="--profile": an op table to $OUT; S=8 EXTRA="--tiles 4x2 --bev-shard xy":
#                                       # 2-D tiles, the BEV grid cut both ways;
#                                       # HW="900 1600": Lift-Splat's and Simple-BEV's images (default 512 1408)
#   bash tools/bev_h200.sh gputests   # the GPU tests, each file in a pytest run of its own (README)
#   bash tools/bev_h200.sh train      # experiment=${EXPERIMENT:-petr_convnext} on ${GPUS:-2} GPUs (S = GPUS) for
#                                       # ${MINUTES:-6} minutes;
#                                       # called again on the warm machine it resumes (MINUTES=15, 24, ...: the total);
#                                       # OVERRIDES="data.batch_size=4 model.num_queries=150": more Hydra overrides
set -uo pipefail  # a failed stage does not stop the next
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(cd "$(dirname "$0")/.." && pwd)"
OUT=${OUT:-.}
BIN=$(dirname "$(command -v python3)")
python3 -m pip install -q --no-index --no-deps --find-links "${WHEELS:-.whl}" hydra-core omegaconf antlr4-python3-runtime torchdata pyyaml
case "${1:-memory}" in
  memory)
    python3 -m pytest -q -p no:cacheprovider tests/ops/test_sample.py -x --tb=short 2>&1 | grep -E "^E |passed|failed" | head -12
    python3 tools/bench_attention.py --check --out "$OUT" --steps 3
    B="python3 benchmarks/spatial_step.py --model petr --cameras 6 --batch 1 --out $OUT --steps 3 --warmup 2"
    $B --height 512 --widths 1408 --spatial 4,8 --precisions fp32,bf16
    $B --height 900 --widths 1600 --spatial 4,8 --precisions fp32
    for size in "512 --widths 1408" "900 --widths 1600"; do
      "$BIN/torchrun" --standalone --nproc-per-node 2 benchmarks/spatial_step.py --model petr --cameras 6 --batch 1 \
        --out "$OUT" --steps 3 --warmup 2 --height $size --spatial 2 --precisions fp32,bf16
    done ;;
  bevformer)
    B="python3 benchmarks/spatial_step.py --model bevformer --cameras 6 --batch 1 --out $OUT --steps 3 --warmup 2"
    $B --height 900 --widths 1600 --spatial 1,2,4,8 --precisions fp32,bf16 --bev-shard x --baseline once ;;
  bevplane)
    for model in lift_splat simple_bev; do
      for bev in x none; do
        python3 benchmarks/spatial_step.py --model $model --cameras 6 --batch 1 --height 512 --widths 1408 \
          --bev-size 200,200 --spatial 2,4,8 --precisions fp32,bf16 --bev-shard $bev --out "$OUT" --steps 3 --warmup 2 \
          --baseline once  # one device's step timed once per precision: the whole input does not depend on S
      done
    done ;;
  trainer)
    read -r h w <<< "${HW:-512 1408}"  # Lift-Splat's and Simple-BEV's images (HW="900 1600")
    declare -A size=([bevformer]="--height 900 --width 1600" [petr]="--height 900 --width 1600"
                     [lift_splat]="--height $h --width $w --bev-size 200,200"
                     [simple_bev]="--height $h --width $w --bev-size 200,200")
    for s in ${S:-4}; do
      for model in ${MODELS:-bevformer lift_splat simple_bev}; do
        python3 benchmarks/trainer_step.py --strategy spatial_tp --fake-world "$s" --baseline device --batch 1 \
          --cameras 6 --bev-shard x --precision "${PRECISION:-32-true}" --warmup 6 --steps 8 --out "$OUT" \
          --model "$model" ${size[$model]} ${EXTRA:-}
      done
    done ;;
  gputests)
    for f in tests/strategy/test_graphs_default.py tests/test_graphs.py; do
      # failures named; a test that stalls dumps every thread's stack after 240 s
      python3 -m pytest -q -p no:cacheprovider -rfEs --disable-warnings -o faulthandler_timeout=240 "$f" 2>&1 | tail -60
    done ;;
  train)
    # a warm machine keeps the run: the next call resumes from its last checkpoint (the time limit counts all calls)
    name=${EXPERIMENT:-petr_convnext} run=/tmp/${EXPERIMENT:-petr_convnext} resume=() gpus=()
    [ -f "$run/checkpoints/last.ckpt" ] && resume=("ckpt_path=$run/checkpoints/last.ckpt")
    [ -n "${GPUS:-}" ] && gpus=("trainer.devices=$GPUS" "strategy.spatial_size=$GPUS")
    "$BIN/torchrun" --standalone --nproc-per-node "${GPUS:-2}" recipes/train.py experiment="$name" validate_first=true \
      ++trainer.max_time="00:00:$(printf %02d "${MINUTES:-6}"):00" trainer.enable_progress_bar=false out="$run" \
      hydra.run.dir="$run" "${gpus[@]}" ${OVERRIDES:-} "${resume[@]}" 2>&1 | tee "$OUT/${name}_train.log" |
      grep -v "Warning\|warn(\|sync_dist=True" | tail -40  # the whole log comes back: a rank's traceback too
    cp "$run/csv/metrics.csv" "$OUT/${name}_metrics.csv" ;;
esac
