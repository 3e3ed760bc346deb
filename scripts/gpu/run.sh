#!/bin/bash
# On the CUDA machine, from the repo root: install the carried wheels (scripts/gpu/fetch_wheels.sh)
# into /tmp/site, then run each named phase; logs and JSON go to $OUT (default ./gpu_out).
#   phases: env | test | ac | b | any shell command
#   e.g. bash scripts/gpu/run.sh env test ac b
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    env) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
         python3 -c 'import sys, torch, triton; print(sys.version, torch.__version__, triton.__version__, torch.cuda.get_device_name())';;
    test) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/model/test_triton_attention.py \
            tests/model/test_fused_kernels.py tests/model/test_lora.py tests/bench/test_gpu_bench.py 2>&1 | tee "$OUT/test.log" | tail -20;;
    ac) timeout 420 python3 -m prelude.cli bench serve --device cuda --scenarios a,c --requests 100 \
          --peers prelude,prelude-unfused,transformers --out "$OUT/gpu_ac" 2>&1 | tee "$OUT/bench_ac.log" | tail -12;;
    b) timeout 420 python3 -m prelude.cli bench serve --device cuda --scenarios b --peers prelude \
         --sweep 1,8,16,32,64,96 --out "$OUT/gpu_b" 2>&1 | tee "$OUT/bench_b.log" | tail -12;;
    *) eval "$phase";;
  esac
done
