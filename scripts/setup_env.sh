#!/usr/bin/env bash
# Create or update .venv (Python >= 3.12) with megatron-mok and what its tests need.
# Idempotent and quick when nothing changed. Prints the venv's python path last.
#   MOK_VENV=path        where the venv lives (default: <repo>/.venv)
#   MOK_PYTHON_BIN=path  the interpreter to build it from (default: first Python >= 3.12 found)
#   MOK_TORCH=spec       torch requirement installed first (default: torch==2.13.0, a CPU-capable build)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MOK_VENV:-$ROOT/.venv}
TORCH_SPEC=${MOK_TORCH:-torch==2.13.0}

python_ok() {  # a working interpreter of version >= 3.12
  [ -n "$1" ] && "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in "${MOK_PYTHON_BIN:-}" python3.13 python3.12 python3; do
    c=$(command -v "$c" 2>/dev/null || true)
    if python_ok "$c"; then echo "$c"; return; fi
  done
  if command -v pyenv >/dev/null 2>&1; then  # pyenv shims can fail for versions that are not selected
    for c in "$(pyenv root)"/versions/3.1[2-9]*/bin/python3.1[2-9]; do
      if python_ok "$c"; then echo "$c"; return; fi
    done
  fi
  echo "error: megatron-mok needs Python >= 3.12 (megatron.training uses typing.override); none found." >&2
  echo "       Install one, or point MOK_PYTHON_BIN at it." >&2
  exit 1
}

if ! python_ok "$VENV/bin/python"; then
  PY=$(find_python)
  echo "[setup] creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
stamp="$VENV/.mok-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing $TORCH_SPEC, megatron-core and megatron-mok into $VENV" >&2
  "${PIP[@]}" install -q "$TORCH_SPEC" "setuptools>=64" wheel
  # No build isolation: the build must see the installed torch, never fetch another one.
  "${PIP[@]}" install -q --no-build-isolation -e "$ROOT[test,plot]"
  echo "$want" > "$stamp"
fi
echo "$VENV/bin/python"
