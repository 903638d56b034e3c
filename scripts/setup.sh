#!/usr/bin/env bash
# Create (or refresh) the virtual environment posttrain runs in, then install posttrain into it.
#
# Why torch first: torch is a range in pyproject.toml, and on Linux a bare `pip install torch`
# resolves to a CUDA build of several GB. Installing the pinned CPU release first (on this kind
# of machine pip finds it on local disk) means the range is already satisfied when posttrain's
# own requirements are resolved, so nothing larger is pulled in. Set POSTTRAIN_TORCH to choose
# another torch (e.g. "torch==2.13.0+cu128" with your own index) or "skip" to keep what is there.
set -euo pipefail
venv="${1:-.venv}"
extras="${2:-dev}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating virtual environment $venv"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    spec="${POSTTRAIN_TORCH:-torch==2.13.0}"
    if [ "$spec" != "skip" ]; then
        echo "[setup] installing $spec (CPU build) before anything that depends on torch"
        "${pip[@]}" install "$spec"
    fi
fi
echo "[setup] installing posttrain[$extras] and its dependencies"
"${pip[@]}" install -e ".[$extras]"
"$venv/bin/python" -c "import torch, transformers, posttrain; print(f'[setup] ready: posttrain {posttrain.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
