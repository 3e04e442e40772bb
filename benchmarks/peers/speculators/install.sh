#!/usr/bin/env bash
# Makes .venv-peers/speculators: vLLM's trainer speculators 0.9.0 from PyPI on torch 2.13.0 (the project's torch).
# Idempotent: a finished install leaves .venv-peers/speculators/.installed-0.9.0 and a rerun stops there.
# Why the steps (LOG.md, 2026-12-06 issue 52 groundwork):
# - speculators requires unpinned torchvision and torchaudio; unconstrained, pip takes torchvision 0.29.1, which
#   swaps torch for 2.14.1 (CUDA, 6 GB), so torch is installed first and then held by a constraint file;
# - the torchvision that fits torch 2.13 (0.28.0) breaks every transformers import ("operator torchvision::nms
#   does not exist"); speculators imports neither package, so both are uninstalled (`pip check` then names them).
set -euo pipefail
VERSION=0.9.0
TORCH=2.13.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="$ROOT/.venv-peers/speculators"
STAMP="$VENV/.installed-$VERSION"
if [[ -f "$STAMP" ]]; then
    echo "speculators $VERSION already installed in $VENV"
    exit 0
fi
mkdir -p "$ROOT/.venv-peers"
[[ -x "$VENV/bin/python" ]] || python3.11 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
CONSTRAINT="$VENV/torch-constraint.txt"
echo "torch==$TORCH" > "$CONSTRAINT"
"$VENV/bin/python" -m pip install -q "torch==$TORCH"
"$VENV/bin/python" -m pip install -q --constraint "$CONSTRAINT" "speculators==$VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio
# the import that torchvision broke, and the versions that the stamp stands for
"$VENV/bin/python" -c "import torch, transformers, speculators.train.cli; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$VENV/bin/python" -m pip freeze > "$STAMP"
echo "speculators $VERSION installed in $VENV"
