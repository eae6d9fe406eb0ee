#!/usr/bin/env bash
# Everything GPU-side in one call (a GPU lease is short): kernel tests on the GPU, the attention benchmark, and
# whole-model training throughput. Run from the repository root on a CUDA machine:
#     OUT=bench/results/gpu bash bench/gpu_session.sh
# Each stage has its own time limit, so a slow stage cannot starve the later ones; logs and CSVs land in $OUT.
set -u
OUT=${OUT:-bench/results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:tests HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"

echo "== 1. kernel tests on the GPU (bf16 / long-sequence tests included; one pinned Triton config)"
SA_TRITON_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-150}" $PY -m pytest -q -m "not slow" -n "${TEST_WORKERS:-8}" \
    -o addopts="" tests/test_kernels_triton.py tests/test_kernels_flex.py > "$OUT/tests.log" 2>&1
echo "pytest exit code $?"; grep -E "passed|failed|Error|FAILED" "$OUT/tests.log" | tail -15

echo "== 2. attention benchmark (bf16, B=1 H=16 D=64 w=256, n=2048..32768; triton, flex, SDPA)"
timeout "${BENCH_TIMEOUT:-270}" $PY -m bench.attention --out "$OUT" 2>&1 | tee "$OUT/bench.log"

echo "== 3. whole model: 360M decoder, B=8, n=2048, bf16 autocast, fwd+bwd per variant"
timeout "${MODEL_TIMEOUT:-90}" $PY -m bench.model --model 360m --batch 8 --out "$OUT" 2>&1 | tee "$OUT/model.log" \
    | grep -v "^{"
