#!/usr/bin/env bash
# Makes .venv-peers/specforge: SGLang's DFlash trainer, pinned, in a venv of its own (python3.11).
# specforge 0.2.0 pins torch==2.11.0 (not our 2.13.0), transformers 5.8.1 and sglang 0.5.14. The CPU build of
# torch 2.11.0 lives only on download.pytorch.org, which this machine cannot reach, so pip takes the CUDA wheel
# from PyPI (torch 2.11.0+cu130 with the nvidia-* runtime): about 11 GB, 4 min. Where the CPU index is reachable
# it is used first (torch 2.11.0+cpu satisfies the pin and saves the torch CUDA libraries); sglang's own CUDA
# dependencies (flashinfer, cuda-toolkit, cutlass) come in either way. Idempotent: a stamp file ends it.
set -euo pipefail
VERSION=0.2.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="$ROOT/.venv-peers/specforge"
STAMP="$VENV/.installed-$VERSION"
if [[ -f "$STAMP" ]]; then
  echo "specforge $VERSION already installed in $VENV"
  exit 0
fi
python3.11 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
if curl -s -o /dev/null --max-time 20 https://download.pytorch.org/whl/cpu/torch/; then
  "${PIP[@]}" install --index-url https://download.pytorch.org/whl/cpu torch==2.11.0
else
  echo "download.pytorch.org unreachable: torch 2.11.0 comes from PyPI as the CUDA wheel"
fi
"${PIP[@]}" install "specforge==$VERSION" "torch==2.11.0" "transformers==5.8.1" "sglang==0.5.14"
"$VENV/bin/python" -c "import specforge, torch, transformers; print('specforge ok, torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
