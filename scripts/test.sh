#!/usr/bin/env bash
# Install everything (CPU) and run the default test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
VENV=${TOKENFLEET_VENV:-.venv}
"$VENV/bin/python" scripts/gen_protos.py --check
"$VENV/bin/ruff" check tokenfleet services tests benchmarks compose scripts
"$VENV/bin/mypy" tokenfleet/engine tokenfleet/routing tokenfleet/models tokenfleet/backends/trtllm tokenfleet/planning tokenfleet/batch
"$VENV/bin/tokenfleet" models import
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit $rc
