#!/usr/bin/env bash
# z-lab's dflash package (PyPI dflash==0.1.0, extra [local]) in a venv of its own: .venv-peers/dflash at the repo
# root. Idempotent: a venv holding the stamp .installed-0.1.0 is left as it is. torch goes in first and pinned
# (2.13.0, ours), so that dflash's unpinned `torch` requirement is already met and pip pulls no other build.
set -euo pipefail
cd "$(dirname "$0")/../../.."
VERSION=0.1.0
VENV=.venv-peers/dflash
STAMP="$VENV/.installed-$VERSION"
if [[ -f "$STAMP" ]]; then
    echo "z-lab dflash $VERSION already installed in $VENV"
    exit 0
fi
mkdir -p .venv-peers
python3.11 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
"$VENV/bin/python" -m pip install --quiet torch==2.13.0 "dflash[local]==$VERSION"
"$VENV/bin/python" -c "import torch, dflash; assert torch.__version__.startswith('2.13.0'), torch.__version__"
touch "$STAMP"
echo "z-lab dflash $VERSION installed in $VENV"
