#!/usr/bin/env bash
# Check and time every kernel on one CUDA GPU in one go: the kernel tests (CPU-shaped tests run
# on CUDA tensors there, plus the `gpu` sweep), then bench_sgmm.py and bench_adafuse.py.
# Results and logs go to $OUT (default bench/results/run); copy the JSON into bench/results/.
#   TUNE=1 bench/gpu_kernels.sh     # also the old whole-add_lora tile sweep
#   SWEEP=1 TRIM=1 SKIP_ADAFUSE=1 bench/gpu_kernels.sh
#       # per-op config sweep + the target shapes only with their baselines, no AdaFuse bench
# The GPU image has its own python3 with torch/triton/pytest; the project's pytest settings
# name plugins it lacks, so the tests run with a minimal ini.
set -uo pipefail
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 ADAPTERMESH_DRIFT_REPORT=1 REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/nvidia_smi.txt"
printf '[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n    slow: slow\n    root: root\n    e2e: e2e\n' \
  > /tmp/pytest_gpu.ini
rc=0
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -c /tmp/pytest_gpu.ini --rootdir . -p no:cacheprovider \
  -q -s tests/kernels 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "DRIFT|passed|failed|Error|FAILED" || true
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "${SGMM_TIMEOUT:-240}" python3 bench/bench_sgmm.py --out "$OUT/sgmm.json" ${TUNE:+--tune} \
  ${SWEEP:+--sweep} ${TRIM:+--trim} 2>&1 | tee "$OUT/bench_sgmm.log" | grep -vE "^(TUNE|SWEEP)" || rc=1
grep -E "^TUNE" "$OUT/bench_sgmm.log" | cut -c1-200 || true
[ -n "${SKIP_ADAFUSE:-}" ] && exit $rc
timeout "${ADAFUSE_TIMEOUT:-150}" python3 bench/bench_adafuse.py --out "$OUT/adafuse.json" \
  2>&1 | tee "$OUT/bench_adafuse.log" | tail -60 || rc=1
exit $rc
