# One device run: the tuned bias-only rows at the TOTAL epsilon (benchmarks/sentiment_tuned_total.py:
# totals 1 / 3 / 8 x seeds 0 / 1 / 2, nine whole procedures at once, one process and one torch
# thread each, with tests/test_cuda.py beside them), then the speed and memory rows
# (benchmarks/gpu_speed.py) in the time left, alone on the GPU. Prepare here, once:
#     .venv/bin/python benchmarks/gpu/make_bundle.py --no-mnist      # .gpu/ and .whl/
# plus the cryptography wheels in .whl/ (README.md beside this file); then on the GPU machine,
# from the repository root:
#     bash benchmarks/gpu/tuned_total.sh
# Results in $OUT: tuned.tgz (every procedure's JSON, log, search ledgers; no model files),
# tuned_table.md, gpu_speed.json, gpu_speed.log, test_cuda.log. END (default 570 s) bounds the
# whole script; SENT_LIMIT (330 s) each procedure; TOTALS= (set and empty) skips the procedures
# (test_cuda and the speed rows only). For a CPU smoke run of the plumbing:
#     PY=.venv/bin/python DEV=cpu TOTALS=8 SEEDS=0 EXTRA="--train-limit 300 --test-limit 100" \
#       SPEED_EXTRA="--tiny --rows minilm-lora" bash benchmarks/gpu/tuned_total.sh
set -u
T0=$(date +%s)
PY=${PY:-python3}; DEV=${DEV:-cuda}; OUT=${OUT:-/tmp/out}; R=${R:-/tmp/tuned}
mkdir -p "$OUT" "$R"
source benchmarks/gpu/setup.sh
export HF_HUB_OFFLINE=1
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if [ "$DEV" = cuda ]; then
  ( timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not runs_train" \
      > "$OUT/test_cuda.log" 2>&1 ) &
fi
for total in ${TOTALS-8 3 1}; do  # TOTALS= (empty): no procedures
  for seed in ${SEEDS:-0 1 2}; do
    ( timeout ${SENT_LIMIT:-330} $PY benchmarks/sentiment_tuned_total.py run --recipe bitfit \
        --total $total --seed $seed --device $DEV --out $R ${EXTRA:-} \
        > $R/log-total$total-s$seed.txt 2>&1; echo "rc $?" >> $R/log-total$total-s$seed.txt ) &
  done
done
sleep 5; [ "$DEV" = cuda ] && sleep 55 && nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
wait
echo "procedures done after $(( $(date +%s) - T0 )) s"
tail -n 2 $R/log-*.txt
$PY benchmarks/sentiment_tuned_total.py summarise --out $R > "$OUT/tuned_table.md" 2>&1
cat "$OUT/tuned_table.md"
tar czf "$OUT/tuned.tgz" --exclude='*.pt' --exclude='*.safetensors' -C $R .
left=$(( ${END:-570} - ($(date +%s) - T0) ))
echo "speed rows: $left s left"
if [ $left -gt 90 ]; then
  timeout $left $PY benchmarks/gpu_speed.py --device $DEV --seconds $(( left - 75 )) \
    --json "$OUT/gpu_speed.json" ${SPEED_EXTRA:-} > "$OUT/gpu_speed.log" 2>&1
  echo "speed rc $?"; cat "$OUT/gpu_speed.log"
fi
ls -la "$OUT"
