# Sourced by the scripts in this folder: make sure .venv exists with the project and its test tools.
# torch is pinned through a constraints file so pip never swaps in a CUDA build on CPU machines;
# set FLUX2_TORCH to another spec (e.g. "torch==2.8.0") on a GPU machine with the matching wheel index.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLUX2_VENV:-$ROOT/.venv}"
STAMP="$VENV/.flux2-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  TORCH_SPEC="${FLUX2_TORCH:-torch==2.13.0}"
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  CONSTRAINTS="$VENV/constraints.txt"
  "$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$CONSTRAINTS"
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e "$ROOT[test]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
