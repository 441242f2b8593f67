#!/usr/bin/env bash
# Every GPU check and the full benchmark, in one script, from any directory:
#
#     bash bench/gpu_all.sh OUT_DIR            # results and logs in OUT_DIR (default: $OUT, else runs/bench/gpu)
#     QUICK=1 bash bench/gpu_all.sh OUT_DIR    # the benchmark's --quick configurations
#     WHEELS=dir bash bench/gpu_all.sh OUT_DIR # first pip-install trl (and its dependencies) from local wheels,
#                                              # for a machine without network: pip download trl -d dir elsewhere
#
# 1. the machine: nvidia-smi, versions                                   -> OUT_DIR/machine.txt
# 2. every GPU-marked test: pytest -m gpu (exit 5, "no tests collected",  -> OUT_DIR/pytest_gpu.log
#    counts as a failure: there are GPU tests, so collecting none means something is wrong):
#    tests/test_gpu.py: --deterministic SFT, DPO and GRPO runs in bf16 agree bit for bit with a rerun; SFT resumed
#    from its sharded checkpoint equals the uninterrupted run; with two GPUs, the same over NCCL (two-process GRPO
#    reruns, each rank writing its own checkpoint shards); tests/test_collectives.py: the CUDA checks of
#    docs/distributed.md (the sampler's host check every 8 tokens, the fp32 reward head under bf16, frozen models'
#    FSDP records, DPO's reference dtype under --dtype fp32); tests/test_logprobs.py: the fused head pass's
#    agreement and peak memory in bf16; tests/test_bench.py: the benchmarks' GPU paths
# 3. python -m bench.run_all --device cuda: sampler vs transformers, SFT/RM/DPO tokens/s and MFU, the reference
#    GRPO step, TRL's GRPOTrainer (or the line saying trl is not installed)
#                                                                         -> OUT_DIR/results.json, bench_cuda.log
#
# The GPU image has torch, transformers and tiktoken but not datasets or wandb: nothing run here imports them at
# module level. Exit status: non-zero if the tests or the benchmark failed; both always run.
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-runs/bench/gpu}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
QUICK_FLAG=""
[ -n "${QUICK:-}" ] && QUICK_FLAG="--quick"

if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install --no-index --find-links "$WHEELS" trl 2>&1 | tail -3 | tee "$OUT_DIR/pip_trl.log" \
    || echo "installing trl from $WHEELS failed: the TRL comparison will say trl is not installed"
fi

{
  date -Is
  nvidia-smi || echo "nvidia-smi failed"
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  for m in transformers trl datasets accelerate pytest; do
    "$PY" -c "import importlib.metadata as md; print('$m', md.version('$m'))" 2>/dev/null || echo "$m not installed"
  done
  git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -20
} > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"

rc_tests=0
if "$PY" -c "import pytest" 2>/dev/null; then
  "$PY" -m pytest -m gpu -v -rs 2>&1 | tee "$OUT_DIR/pytest_gpu.log"
  rc_tests=${PIPESTATUS[0]}
else
  echo "pytest is not installed: GPU tests not run" | tee "$OUT_DIR/pytest_gpu.log"
  rc_tests=1
fi

"$PY" -m bench.run_all --device cuda $QUICK_FLAG --out "$OUT_DIR/results.json" 2>&1 | tee "$OUT_DIR/bench_cuda.log"
rc_bench=${PIPESTATUS[0]}

# ---- --compile (the compiled decode step) against eager ----
# decode tokens/s of gpt2 (bf16) at 1,024 rows (16 prompts x 64 samples, 352-384-token prompts, 56 new tokens) and the
# reference GRPO step time (bench/grpo_step.py's gpu-reference), each with and without --compile, compilation timed
# apart (bench/compiled.py)                                              -> OUT_DIR/compile.json, compile_cuda.log
"$PY" -m bench.run_all --device cuda $QUICK_FLAG --only compile --out "$OUT_DIR/compile.json" 2>&1 \
  | tee "$OUT_DIR/compile_cuda.log"
rc_compile=${PIPESTATUS[0]}
[ "$rc_compile" -eq 0 ] || rc_bench=$rc_compile
# ---- end of the --compile block ----

echo "gpu_all: pytest -m gpu exit $rc_tests, bench.run_all exit $rc_bench; results in $OUT_DIR" | tee "$OUT_DIR/summary.txt"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
