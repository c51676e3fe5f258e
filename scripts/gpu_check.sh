#!/usr/bin/env bash
# Issue 25's device checks in one run, for a session lent a GPU machine (README "On a GPU"):
#   1. the GPU tests and the Triton kernel tests on the GPU (graphs, FP8 weights, FP8 KV cache, overlapped
#      scheduling against synchronous steps), about 2 minutes;
#   2. benchmarks/gpu_step.py (every mode, both geometries, about 8 minutes; extra arguments go to it, e.g.
#      --modes graphs,graphs-overlap to measure fewer).
# Results land in $OUT (the device tool's output folder), else /tmp/gpu-check.
#
#     scripts/gpu_check.sh [gpu_step.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout 240 python3 -m pytest -q tests/gpu tests/unit/models/test_triton_attention.py tests/unit/models/test_triton_ops.py \
    tests/unit/models/test_kv_fp8.py -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest.txt"
timeout 560 python3 benchmarks/gpu_step.py --out "$OUT" "$@" 2>&1 | tail -120 | tee "$OUT/gpu_step.txt"
