#!/usr/bin/env bash
# Create .venv and install GPU Medic into it (editable), for development. Usage: scripts/setup.sh [EXTRA]
#   EXTRA: "server" (the default) for every `medic` command, "test" for the test suite as well.
# Users install the package instead (docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-server}
python=${PYTHON:-python3}
"$python" - <<'PY' || { echo "GPU Medic needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(sys.version_info < (3, 11))
PY
[ -x .venv/bin/python ] || "$python" -m venv .venv
spec=".[$extra]"
stamp=".venv/.medic-installed-$extra"
# Reinstall only when the dependency list changed: a warm venv costs nothing.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec"
  touch "$stamp"
fi
