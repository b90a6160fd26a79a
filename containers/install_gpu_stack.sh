#!/usr/bin/env bash
# Installs AsyncFlow's GPU stack into /opt/venv and AsyncFlow from /opt/asyncflow (the repository, copied in by
# the Dockerfile or asyncflow.def). The pins are setup.py's GPU_STACK, written out here so the image says what
# it holds; tests/recipes/test_containers.py keeps them equal to setup.py's.
set -euo pipefail

python3 -m venv /opt/venv
# shellcheck source=/dev/null
source /opt/venv/bin/activate
pip install --no-cache-dir --upgrade pip setuptools wheel

# vLLM first: it pins the CUDA build of torch that everything else is built against.
pip install --no-cache-dir "vllm==0.32.0" "megatron-core==0.16.1" "ray==2.60.0"
# Transformer Engine's PyTorch extension is a source distribution: built here against that torch, with the
# image's nvcc and cuDNN headers (core_cu13: the core library for CUDA 13, as megatron-core 0.16.1 asks).
pip install --no-cache-dir pybind11 ninja
NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-8} \
    pip install --no-cache-dir --no-build-isolation "transformer-engine[core_cu13,pytorch]>=2.9,<2.12"
# AsyncFlow and its own dependencies; the gpu extra is satisfied by the lines above.
pip install --no-cache-dir "/opt/asyncflow[gpu]"
python - <<'PY'
import importlib.metadata as md

for name in ("vllm", "megatron-core", "transformer-engine", "ray", "torch", "asyncflow"):
    print(f"{name}=={md.version(name)}")
PY
