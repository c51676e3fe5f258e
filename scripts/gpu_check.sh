#!/usr/bin/env bash
# The GPU device checks in one run, for a session lent a GPU machine (docs/gpu.md), each phase capped so
# the whole run fits the device tool's 10-minute command limit:
#   0. with .gpu/ carried (scripts/gpu_bundle.sh): install its wheels into /tmp/site, unpack etcd, and write random
#      weights in SmolLM2's shape with its real tokenizer (tokenfleet models random);
#   1. the GPU tests and the Triton kernel tests on the GPU (graphs, FP8 weights, FP8 KV cache, overlapped
#      scheduling against synchronous steps), at most $TEST_S seconds (default 110; 0 skips a phase);
#   2. benchmarks/gpu_step.py, at most $STEP_S seconds (default 300); extra arguments go to it, e.g.
#      --modes graphs,graphs-overlap to measure fewer; with $STEP2_ARGS, a second run with those arguments (its
#      JSON and report named gpu-step-2), at most $STEP2_S seconds (default 120);
#   3. with .gpu/: benchmarks/gpu_serve.py, `tokenfleet up` under streamed load at c=1 and c=64, at most $SERVE_S
#      seconds (default 130; $SERVE_VARIANTS, default "default,async"; $SERVE_ARGS, more arguments to it, e.g.
#      "--rounds 3 --concurrency 1").
# The phases together stop within $TOTAL_S seconds (default 570) of the script's start. Results land in $OUT (the
# device tool's output folder, at most 8 files come back), else /tmp/gpu-check.
#
#     scripts/gpu_check.sh [gpu_step.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
if [ -d .gpu/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
      2>&1 | tail -3 | tee -a "$LOG"
  export PYTHONPATH=$PWD:/tmp/site
fi
# a checkout that is not installed: services/ is the package tokenfleet.services (setup.py's package_dir)
python3 -c "import tokenfleet.services" 2>/dev/null || ln -sfn ../services tokenfleet/services
if [ -f .gpu/etcd.gz ]; then
  gunzip -c .gpu/etcd.gz > /tmp/etcd && chmod +x /tmp/etcd && export ETCD_BIN=/tmp/etcd
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
# Each phase gets its own cap (0 skips it), cut to what is left of $TOTAL_S (default 570 s: the device tool's
# 600-second command limit, less the set-up); `timeout -k` kills a phase that ignores its SIGTERM.
TOTAL_S=${TOTAL_S:-570}
cap() {
  local want=$1 left=$(( TOTAL_S - SECONDS ))
  if [ "$want" -le 0 ] || [ "$left" -le 15 ]; then echo 0; else echo $(( want < left ? want : left )); fi
}
t=$(cap "${TEST_S:-110}")
echo "== tests, ${t} s ($(date +%T))" | tee -a "$LOG"
if [ "$t" -gt 0 ]; then
  # the newest paths first, in case the cap cuts the run short
  timeout -k 10 "$t" python3 -m pytest -v --tb=short -p no:cacheprovider tests/gpu/test_graphs_device.py \
      tests/unit/models/test_kv_fp8.py tests/unit/models/test_triton_attention.py tests/unit/models/test_triton_ops.py \
      tests/unit/models/test_triton_linear.py tests/unit/models/test_triton_logits.py \
      tests/gpu/test_cuda_engine.py tests/gpu/test_controls_device.py tests/gpu/test_kv_transfer_device.py \
      > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?" | tee -a "$LOG"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest.txt" | tail -40 >> "$LOG"
fi
t=$(cap "${STEP_S:-300}")
echo "== gpu_step, ${t} s ($(date +%T))" | tee -a "$LOG"
if [ "$t" -gt 0 ]; then
  timeout -k 10 "$t" python3 benchmarks/gpu_step.py --out "$OUT" "$@" 2>&1 | tee -a "$LOG" | tail -60
  echo "gpu_step rc=$? ($(date +%T))" | tee -a "$LOG"
fi
t=$(cap "${STEP2_S:-120}")
if [ -n "${STEP2_ARGS:-}" ] && [ "$t" -gt 0 ]; then
  echo "== gpu_step (2), ${t} s ($(date +%T))" | tee -a "$LOG"
  # shellcheck disable=SC2086 # word splitting intended; quote a semicolon list inside it
  eval "timeout -k 10 $t python3 benchmarks/gpu_step.py --out \"\$OUT\" --name gpu-step-2 $STEP2_ARGS" 2>&1 \
      | tee -a "$LOG" | tail -30
  echo "gpu_step (2) rc=$? ($(date +%T))" | tee -a "$LOG"
fi
t=$(cap "${SERVE_S:-130}")
if [ -d .gpu/like ] && [ "$t" -gt 30 ]; then
  echo "== gpu_serve, ${t} s ($(date +%T))" | tee -a "$LOG"
  python3 -m tokenfleet.cli models random .gpu/like /tmp/smollm2-random 2>&1 | tail -1 | tee -a "$LOG"
  # new runs start only in the first 2/3 of the cap: stopping a cluster takes up to 40 s
  timeout -k 10 "$t" python3 benchmarks/gpu_serve.py --model /tmp/smollm2-random --out "$OUT" \
      --log /tmp/gpu-serve-up.log --variants "${SERVE_VARIANTS:-default,async}" --budget-s $(( t * 2 / 3 )) \
      ${SERVE_ARGS:-} 2>&1 | tee -a "$LOG" | tail -30
  echo "gpu_serve rc=$? ($(date +%T))" | tee -a "$LOG"
  grep -E -i "error|traceback|exception" /tmp/gpu-serve-up.log | head -20 >> "$LOG"
fi
