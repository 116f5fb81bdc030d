# Sourced by the scripts in this folder: make sure .venv exists with the project and its test tools.
# torch is pinned through a constraints file so pip never swaps in a CUDA build on CPU machines;
# set FLUX2_TORCH to another spec (e.g. "torch==2.8.0") on a GPU machine with the matching wheel index.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLUX2_VENV:-$ROOT/.venv}"
STAMP="$VENV/.flux2-installed"
say() { echo "[setup] $*" >&2; }
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  START=$SECONDS
  if [ -f "$STAMP" ]; then
    say "pyproject.toml changed: updating the packages in $VENV"
  else
    say "first run: installing the Python packages into $VENV (once; 2-5 minutes on a fast connection)"
  fi
  python3 -m venv "$VENV"
  say "1/3 pip"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  TORCH_SPEC="${FLUX2_TORCH:-torch==2.13.0}"
  say "2/3 $TORCH_SPEC (the largest download: about 200 MB for a CPU build, a few GB with CUDA)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
  CONSTRAINTS="$VENV/constraints.txt"
  "$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$CONSTRAINTS"
  say "3/3 the engine and its packages (transformers, safetensors, gguf, ...; diffusers and pytest for the tests)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" -e "$ROOT[test]"
  # mlx-vlm runs flux3-mlx's prompt upsampler, the upsampler tests' reference; its own requirements are a server,
  # audio and video stacks the tests never import, so it comes without them
  if [ "$(uname -s)" = Linux ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "mlx-vlm==0.7.10"
  fi
  touch "$STAMP"
  say "ready after $((SECONDS - START)) s; later runs start right away"
fi
export PATH="$VENV/bin:$PATH"
