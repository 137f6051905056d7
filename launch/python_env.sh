# Sourced by the launch scripts (from the repository root): sets PY, the Python they install
# into and run, and fl_install_torch.
#   PYTHON=/path/to/python        that interpreter, as is
#   VIRTUAL_ENV (an activated venv) or CONDA_PREFIX (an active conda env): its python, as is
#   otherwise                     the virtual environment .venv in the repository, created on
#                                 first use from python3 (Debian's and Ubuntu's own Python
#                                 refuse pip installs, PEP 668; launch/deps.sh installs
#                                 python3-venv)
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"
elif [ -n "${CONDA_PREFIX:-}" ]; then
  PY="$CONDA_PREFIX/bin/python"
else
  if [ ! -x .venv/bin/python ]; then
    echo "== creating the virtual environment .venv with $(command -v python3) ($(python3 -V 2>&1))"
    python3 -m venv .venv || {
      echo "python3 -m venv failed: install python3-venv (launch/deps.sh does), or set PYTHON" >&2
      exit 1
    }
  fi
  PY="$PWD/.venv/bin/python"
fi
export PY
echo "== Python: $PY ($("$PY" -V 2>&1))"

# torch, unless the environment has it. On a machine without a GPU the CPU-only wheels
# (download.pytorch.org/whl/cpu, ~200 MB) are used when that index answers; PyPI's torch also
# brings its CUDA libraries (several GB). FUSEDLOSS_TORCH_INDEX=pypi|cpu|<url> decides instead.
fl_install_torch() {
  "$PY" -c "import torch" 2>/dev/null && return 0
  local index=${FUSEDLOSS_TORCH_INDEX:-auto} cpu=https://download.pytorch.org/whl/cpu
  if [ "$index" = auto ]; then
    index=pypi
    if ! nvidia-smi -L >/dev/null 2>&1 &&
       "$PY" -c "import urllib.request as u; u.urlopen('$cpu/torch/', timeout=10)" 2>/dev/null; then
      index=cpu
    fi
  fi
  [ "$index" = cpu ] && index=$cpu
  if [ "$index" = pypi ]; then
    echo "== installing torch from PyPI (with its CUDA libraries: several GB)"
    "$PY" -m pip install -q "torch>=2.4"
  else
    echo "== installing torch from $index"
    "$PY" -m pip install -q "torch>=2.4" --index-url "$index"
  fi
}
