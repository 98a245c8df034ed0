#!/usr/bin/env bash
# Worker-engine GPU run: the gpu-marked worker tests, then bench/bench_engine.py.
# Runs on the GPU machine from the repository root; results go to $OUT (default ./gpu_out).
# The GPU image has no pytest-asyncio/pytest-timeout, so pytest runs with a minimal ini.
# Knobs: SKIP_TESTS=1, TEST_K=<pytest -k expr>, BENCH_ARGS (e.g. "--only adafuse_engine").
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src REQUIRE_GPU=1
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
} > "$OUT/engine_env.txt" 2>&1
printf '[pytest]\nmarkers =\n  gpu: gpu\n  slow: slow\n  root: root\n  e2e: e2e\n' > "$OUT/pytest_gpu.ini"
if [ -z "${SKIP_TESTS:-}" ]; then
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -c "$OUT/pytest_gpu.ini" --rootdir "$PWD" -p no:cacheprovider \
  -q -m gpu ${TEST_K:+-k "$TEST_K"} tests/worker/test_gpu.py > "$OUT/engine_gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/engine_gpu_tests.txt"
tail -5 "$OUT/engine_gpu_tests.txt"
fi
timeout "${BENCH_TIMEOUT:-330}" python3 bench/bench_engine.py --out "$OUT/engine_h200.json" ${BENCH_ARGS:-} 2>&1 \
  | grep -v "attention mask\|deprecated\|warn" > "$OUT/bench_engine.log"
echo "bench rc=${PIPESTATUS[0]}"
tail -25 "$OUT/bench_engine.log"
