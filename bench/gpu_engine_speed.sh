#!/usr/bin/env bash
# Engine speed run on one GPU, from the repository root: the gpu-marked kernel and worker tests,
# then bench/bench_engine_speed.py, then bench/bench_service.py --mix; a summary table last.
# Results, logs and environment go to $OUT (default ./gpu_out): engine_speed_h200.json,
# engine_speed_h200_http.json, *.log, engine_speed_env.txt.
#
# The whole script keeps to TOTAL_BUDGET seconds of wall time (default 530): each stage's
# timeout is cut to what is left, after the reserve of the stages behind it, and the engine
# bench gets that as --budget-s, so it skips a section (hf_static first, it runs last) rather
# than overrun. A run that is cut short keeps every finished section: both benches rewrite
# their JSON as they go.
#
# Knobs: SKIP_TESTS=1, SKIP_BENCH=1, SKIP_HTTP=1; TEST_TIMEOUT (100), BENCH_TIMEOUT (cap for the
# engine bench, default: all that is left), HTTP_TIMEOUT (210, also the reserve kept for it);
# TEST_K (pytest -k), BENCH_ARGS (e.g. "--skip hf_static"), MIX_CAPACITY_S (45), MIX_RUN_S (50),
# HTTP_ARGS (more bench_service.py --mix flags), TOTAL_BUDGET.
#   bench/gpu_engine_speed.sh                   # all three in ~9 min; hf_static gets what is left
#   SKIP_HTTP=1 bench/gpu_engine_speed.sh       # tests + every engine section, hf_static included
#   SKIP_TESTS=1 SKIP_BENCH=1 bench/gpu_engine_speed.sh    # the HTTP mix alone
# The GPU image's python3 has no pytest-asyncio, so pytest runs with a minimal ini that sets no
# asyncio or timeout option; the gpu-marked worker tests drive the engine with asyncio.run.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 REQUIRE_GPU=1
T0=$(date +%s)
TOTAL_BUDGET=${TOTAL_BUDGET:-530}
HTTP_TIMEOUT=${HTTP_TIMEOUT:-210}
left() { echo $(( TOTAL_BUDGET - ($(date +%s) - T0) )); }
# limit WANT RESERVE: WANT seconds, or less so that RESERVE seconds stay for later stages.
limit() {
  local want=$1 room
  room=$(( $(left) - $2 ))
  [ "$room" -lt "$want" ] && want=$room
  [ "$want" -lt 1 ] && want=1
  echo "$want"
}
http_reserve=$HTTP_TIMEOUT
[ -n "${SKIP_HTTP:-}" ] && http_reserve=0

{
  date -u +%FT%TZ
  hostname
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv
  python3 -c 'import torch, triton, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
  git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -30
} > "$OUT/engine_speed_env.txt" 2>&1
head -4 "$OUT/engine_speed_env.txt"

test_rc=skipped
if [ -z "${SKIP_TESTS:-}" ]; then
  printf '[pytest]\nmarkers =\n  gpu: gpu\n  slow: slow\n  root: root\n  e2e: e2e\n' > "$OUT/pytest_gpu.ini"
  t=$(limit "${TEST_TIMEOUT:-100}" $(( http_reserve + 200 )))
  timeout -k 10 "$t" python3 -m pytest -c "$OUT/pytest_gpu.ini" --rootdir "$PWD" -p no:cacheprovider \
    -q -m gpu ${TEST_K:+-k "$TEST_K"} tests/kernels tests/worker > "$OUT/gpu_tests.log" 2>&1
  test_rc=$?
  echo "gpu tests rc=$test_rc (timeout ${t}s)"
  tail -4 "$OUT/gpu_tests.log"
fi

bench_rc=skipped
if [ -z "${SKIP_BENCH:-}" ]; then
  t=$(limit "${BENCH_TIMEOUT:-100000}" "$http_reserve")
  # The bench's own budget ends 15 s before the hard timeout: room for shutdown and the last save.
  timeout -k 10 "$t" python3 bench/bench_engine_speed.py --out "$OUT/engine_speed_h200.json" \
    --budget-s $(( t > 30 ? t - 15 : t )) ${BENCH_ARGS:-} > "$OUT/bench_engine_speed.log" 2>&1
  bench_rc=$?
  echo "bench_engine_speed rc=$bench_rc (timeout ${t}s)"
  tail -2 "$OUT/bench_engine_speed.log"
fi

http_rc=skipped
if [ -z "${SKIP_HTTP:-}" ]; then
  t=$(limit "$HTTP_TIMEOUT" 5)
  timeout -k 10 "$t" python3 bench/bench_service.py --mix --device cuda \
    --out "$OUT/engine_speed_h200_http.json" --mix-capacity-s "${MIX_CAPACITY_S:-45}" \
    --mix-run-s "${MIX_RUN_S:-50}" ${HTTP_ARGS:-} > "$OUT/bench_service_mix.log" 2>&1
  http_rc=$?
  echo "bench_service --mix rc=$http_rc (timeout ${t}s)"
  grep "^\[bench_service" "$OUT/bench_service_mix.log" | tail -3
fi

echo "== summary (wall $(( $(date +%s) - T0 )) s; tests rc=$test_rc, engine bench rc=$bench_rc, http rc=$http_rc) =="
python3 - "$OUT/engine_speed_h200.json" "$OUT/engine_speed_h200_http.json" <<'EOF'
import json, sys
from pathlib import Path


def fmt(v):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


for path in sys.argv[1:]:
    p = Path(path)
    if not p.exists():
        print(f"{p.name}: missing")
        continue
    try:
        r = json.loads(p.read_text())
    except ValueError as e:
        print(f"{p.name}: unreadable ({e})")
        continue
    for name, t in (r.get("targets") or {}).items():
        extra = ""
        if "pct_of_copy_bw" in t:
            extra = f"  ({fmt(t['pct_of_copy_bw'])}% of copy bw)"
        print(f"{name:36s} {fmt(t.get('value')):>10s}  {t.get('target', ''):34s} {fmt(t.get('met'))}{extra}")
    for key in ("hf_static", "step_split", "capacity", "load", "batch1", "batch64", "sampling", "prefix"):
        sec = r.get(key)
        if isinstance(sec, dict) and ("error" in sec or "skipped" in sec):
            print(f"  {p.name} {key}: {sec.get('error') or 'skipped: ' + str(sec.get('skipped'))}")
    hf = r.get("hf_static") or {}
    for k in sorted(k for k in hf if k.startswith("batch")):
        if isinstance(hf[k], dict) and "decode_ms_per_token" in hf[k]:
            print(f"  hf_static {k}: {fmt(hf[k]['decode_ms_per_token'])} ms/token, {fmt(hf[k]['decode_tok_s'])} tok/s")
    fl = r.get("floor")
    if fl:
        print(f"  http floor: bound {fmt(fl.get('bound_output_tok_s'))} output tok/s, "
              f"serial estimate {fmt(fl.get('serial_estimate_output_tok_s'))}")
EOF
