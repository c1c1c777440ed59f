# The 12 tuned rows of benchmarks/sentiment.py on one GPU, one process per row, all at once
# (1 torch thread each; 12 rows took 3.6-6.4 minutes each on an H200 with 16 cores), with
# tests/test_cuda.py beside them. Results, logs and the searches' ledgers (no model files) go to
# $OUT/sent.tgz. Run from the repository root with .gpu/ and .whl/ present:
#     source benchmarks/gpu/setup.sh && LIMIT=465 bash benchmarks/gpu/sentiment.sh
LIMIT=${LIMIT:-480}; R=/tmp/sent; mkdir -p $R $OUT
( timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda.log 2>&1 ) &
for c in lpft-eps1 lpft-eps3 lpft-eps8 bitfit-eps1 bitfit-eps3 bitfit-eps8 \
         lora16all-eps1 lora16all-eps3 lora16all-eps8 \
         lpft-nonprivate bitfit-nonprivate lora16all-nonprivate; do
  ( timeout $LIMIT python3 benchmarks/sentiment.py --configs $c --device cuda --threads 1 \
      --out $R > $R/log-$c.txt 2>&1; echo "rc $?" >> $R/log-$c.txt ) &
done
sleep 65; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
wait
cd $R && tar czf $OUT/sent.tgz --exclude='*.pt' --exclude='*.safetensors' . && ls -la $OUT
tail -n 3 $R/log-*.txt
