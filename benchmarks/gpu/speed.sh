# Step time and peak device memory on one GPU: plain vs dpfy vs Opacus ghost/hooks, interleaved
# (benchmarks/gpu_speed.py; about 6 minutes on an H200). Random weights from transformers
# configs: no data or weights travel, only the Opacus wheels (and the cryptography wheels for
# secure noise, if the machine lacks cryptography). Prepare here, once:
#     .venv/bin/python benchmarks/gpu/make_bundle.py --peer-wheels     # writes .whl/
# then run on the GPU machine from the repository root (.whl/ travels with the tree):
#     bash benchmarks/gpu/speed.sh
# Results: $OUT/gpu_speed.json and $OUT/gpu_speed.log.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/whl .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/whl PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
timeout ${LIMIT:-420} python3 benchmarks/gpu_speed.py --device cuda --seconds ${SECONDS_BUDGET:-330} \
  --json "$OUT/gpu_speed.json" 2>&1 | tee "$OUT/gpu_speed.log"
echo "rc ${PIPESTATUS[0]}"
