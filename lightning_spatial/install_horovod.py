"""Build and install Horovod 0.28.1 into the current environment, for today's PyTorch.

    python -m lightning_spatial.install_horovod            # gloo on CPU; NCCL too where CUDA is present
    python -m lightning_spatial.install_horovod --force    # rebuild even if a cached wheel exists

Horovod's last release compiles as C++14 while torch's headers need C++17 (torch 2.1-2.13) or C++20
(torch 2.14), and its bundled gloo stops
at CMake 4's ``cmake_minimum_required`` check; on a machine without GPUs, a CUDA build of torch makes it
compile CUDA paths it cannot link. We take the sdist from the package registry, switch the C++ standard
to torch's (and, without GPUs, build the CPU extension), build a wheel without build isolation (against
the installed torch) and cache it under
``~/.cache/lightning_spatial/wheels`` keyed by Python, torch and GPU support, so repeat installs are fast.

System prerequisites: a C++ compiler for torch's C++ standard (g++ >= 10 or clang for C++20), ``make`` and
the Python headers (Debian/Ubuntu: ``apt-get install g++ make python3-dev``); CMake comes from PyPI if missing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.28.1"
RUNTIME_DEPS = ["cloudpickle", "psutil", "pyyaml", "packaging", "cffi>=1.4.0"]
CACHE = Path(os.environ.get("LIGHTNING_SPATIAL_CACHE", Path.home() / ".cache" / "lightning_spatial")) / "wheels"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build_env(gpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HOROVOD_WITH_PYTORCH": "1",
            "HOROVOD_WITHOUT_TENSORFLOW": "1",
            "HOROVOD_WITHOUT_MXNET": "1",
            "HOROVOD_WITH_GLOO": "1",
            "HOROVOD_WITHOUT_MPI": "1",
            "HOROVOD_CPU_OPERATIONS": "GLOO",
            "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
            "MAKEFLAGS": f"-j{os.cpu_count() or 2}",
        }
    )
    if gpu:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    return env


def torch_cxx_standard() -> int:
    """The C++ standard the installed torch's headers demand (17 up to torch 2.13, 20 from 2.14)."""
    import torch

    aten = Path(torch.__file__).parent / "include" / "ATen" / "ATen.h"
    return 20 if aten.exists() and "C++20" in aten.read_text() else 17


def patch_cxx_standard(source: Path, standard: int) -> None:
    for cmake in (source / "CMakeLists.txt", source / "horovod" / "torch" / "CMakeLists.txt"):
        text = cmake.read_text()
        patched = re.sub(r"set\(CMAKE_CXX_STANDARD 1[47]\)", f"set(CMAKE_CXX_STANDARD {standard})", text)
        if patched == text and f"CMAKE_CXX_STANDARD {standard}" not in text:
            raise RuntimeError(f"{cmake}: no C++ standard setting to patch; is this Horovod {VERSION}?")
        cmake.write_text(patched)


def patch_cpu_only(source: Path) -> None:
    """Build the CPU (gloo) extension even against a CUDA build of torch on a machine without a usable
    CUDA toolkit: Horovod would otherwise compile its CUDA paths because torch reports CUDA."""
    find = source / "cmake" / "Modules" / "FindPytorch.cmake"
    probe = "print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)"
    text = find.read_text()
    if probe not in text:
        raise RuntimeError(f"{find}: the CUDA probe to patch was not found; is this Horovod {VERSION}?")
    find.write_text(text.replace(probe, "print(False)"))


def wheel_tag() -> str:
    import torch

    gpu = "cuda" if torch.cuda.is_available() else "cpu"
    return f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.replace('+', '_')}-{gpu}"


def build_wheel(gpu: bool) -> Path:
    target = CACHE / wheel_tag()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _pip("download", "--no-deps", "--no-binary", ":all:", f"horovod=={VERSION}", "-d", str(tmp))
        with tarfile.open(next(tmp.glob("horovod-*.tar.gz"))) as sdist:
            sdist.extractall(tmp, filter="data")
        source = tmp / f"horovod-{VERSION}"
        patch_cxx_standard(source, torch_cxx_standard())
        if not gpu:
            patch_cpu_only(source)
        if shutil.which("cmake") is None:
            _pip("install", "cmake")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-build-isolation",
                "--no-deps",
                "-w",
                str(tmp / "dist"),
                str(source),
            ],
            check=True,
            env=build_env(gpu),
        )
        target.mkdir(parents=True, exist_ok=True)
        wheel = next((tmp / "dist").glob("horovod-*.whl"))
        shutil.copy(wheel, target / wheel.name)
    return target / wheel.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    args = parser.parse_args(argv)
    import torch

    _pip("install", "-q", *RUNTIME_DEPS)
    cached = sorted((CACHE / wheel_tag()).glob("horovod-*.whl"))
    wheel = cached[-1] if cached and not args.force else build_wheel(torch.cuda.is_available())
    _pip("install", "-q", "--no-deps", "--force-reinstall", str(wheel))
    check = "import horovod, horovod.torch as hvd; hvd.init(); print('horovod', horovod.__version__, hvd.gloo_built())"
    subprocess.run([sys.executable, "-c", check], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
