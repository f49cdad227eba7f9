"""Trident: a Megatron-based 3D-parallel PPO engine for RLHF."""
from pathlib import Path

from setuptools import find_packages, setup


def _requirements(name: str) -> list[str]:
    """The requirements of ``requirements/<name>``, following its ``-r other.txt`` lines."""
    lines = [line.strip() for line in (Path(__file__).parent / "requirements" / name).read_text().splitlines()]
    found: list[str] = []
    for line in lines:
        if line.startswith("-r "):
            found += _requirements(line[3:].strip())
        elif line and not line.startswith("#"):
            found.append(line)
    return found


setup(
    name="trident-ppo",
    version="0.1.0",
    description="Megatron-based 3D-parallel PPO engine for RLHF of large language models",
    python_requires=">=3.11",
    packages=find_packages(include=["engine*", "parallel*", "launch*", "benchmarks*"]),
    install_requires=_requirements("base.txt"),
    entry_points={"console_scripts": ["trident=launch.cli:command"]},
    extras_require={
        # transformer-engine builds only against CUDA/NCCL headers: GPU machines only. The range is
        # megatron-core 0.16.1's own (its "dev" extra), for torch 2.14.1's CUDA 13 build.
        "gpu": ["transformer-engine[pytorch,core_cu13]>=2.9,<2.12", "sglang==0.5.23"],
        "sglang-cpu": _requirements("sglang-cpu.txt") + ["sglang==0.5.23"],
        "wandb": _requirements("wandb.txt"),
        "mlflow": _requirements("mlflow.txt"),
        "test": _requirements("test.txt"),
    },
)
