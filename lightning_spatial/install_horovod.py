"""Build and install Horovod 0.28.1 into the current environment, for today's PyTorch.

    python -m lightning_spatial.install_horovod                    # gloo on CPU; NCCL too where a GPU is present
    python -m lightning_spatial.install_horovod --force            # rebuild even if a cached wheel exists
    python -m lightning_spatial.install_horovod --download DIR     # fetch the sdist and runtime wheels into DIR
    python -m lightning_spatial.install_horovod --from DIR         # offline: build or install from DIR only

Horovod's last release compiles as C++14 while torch's headers need C++17 (torch 2.1-2.13) or C++20
(torch 2.14), and its bundled gloo stops at CMake 4's ``cmake_minimum_required`` check; on a machine without
GPUs, a CUDA build of torch makes it compile CUDA paths it cannot link. We take the sdist (from the package
registry, or from ``--from DIR`` on an air-gapped machine), switch the C++ standard to torch's (and, without
GPUs, build the CPU extension), build a wheel without build isolation (against the installed torch) and cache
it under ``~/.cache/lightning_spatial/wheels`` keyed by Python, torch and GPU support.

With a GPU, collectives run on NCCL: the NCCL that torch's wheel ships (``nvidia-nccl-*``) unless
``HOROVOD_NCCL_HOME`` names another, CUDA kernels built only for the GPUs present (``HOROVOD_BUILD_CUDA_CC_LIST``),
as C++17 (CUDA 13's minimum).

System prerequisites: a C++ compiler for torch's C++ standard (g++ >= 10 or clang for C++20), ``make`` and
the Python headers (Debian/Ubuntu: ``apt-get install g++ make python3-dev``); CMake comes from PyPI if missing;
with a GPU also nvcc, the CUDA headers and NCCL. What is missing is named before the build starts.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
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
            # Horovod's sources lean on <string>/<stdexcept> arriving through other headers, which GCC 13 no
            # longer does ("'string' in namespace 'std' does not name a type")
            "CXXFLAGS": f"{os.environ.get('CXXFLAGS', '')} -include string -include stdexcept".strip(),
        }
    )
    if gpu:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        env.setdefault("HOROVOD_BUILD_CUDA_CC_LIST", ",".join(gpu_capabilities()))
    return env


def gpu_capabilities() -> list[str]:
    """Compute capabilities of the visible GPUs (e.g. ``["90"]``): the CUDA kernels are built for these only."""
    import torch

    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return sorted(f"{major}{minor}" for major, minor in caps)


def torch_nccl(scratch: Path) -> dict[str, str]:
    """Point Horovod at the NCCL that torch's wheel ships (``nvidia/nccl``): it has ``libnccl.so.2`` but no
    ``libnccl.so`` for the linker, so link one in a scratch folder. Empty if torch ships none."""
    try:
        import nvidia.nccl  # the nvidia-nccl-cu* wheel torch depends on
    except ImportError:
        return {}
    home = Path(next(iter(nvidia.nccl.__path__)))
    libs = sorted((home / "lib").glob("libnccl.so*"))
    if not (home / "include" / "nccl.h").exists() or not libs:
        return {}
    lib = scratch / "nccl-lib"
    lib.mkdir(exist_ok=True)
    (lib / "libnccl.so").symlink_to(libs[-1])
    return {"HOROVOD_NCCL_INCLUDE": str(home / "include"), "HOROVOD_NCCL_LIB": str(lib), "HOROVOD_NCCL_LINK": "SHARED"}


def missing_prerequisites(gpu: bool, env: dict[str, str]) -> list[str]:
    """What the build needs and this machine lacks, each with what to install."""
    missing = []
    if not (shutil.which(env.get("CXX", "c++")) or shutil.which("g++")):
        missing.append("a C++ compiler (c++/g++; Debian/Ubuntu: apt install g++)")
    if not shutil.which("make"):
        missing.append("make (apt install make)")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        missing.append(f"the Python headers (Python.h in {sysconfig.get_paths()['include']}; apt install python3-dev)")
    if gpu:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
            missing.append("nvcc (the CUDA toolkit; set CUDA_HOME)")
        elif not (Path(CUDA_HOME) / "include" / "cuda_runtime_api.h").exists():
            missing.append(f"the CUDA headers (cuda_runtime_api.h under {CUDA_HOME}/include)")
        if not ("HOROVOD_NCCL_HOME" in env or "HOROVOD_NCCL_INCLUDE" in env):
            missing.append("NCCL (torch's nvidia-nccl wheel was not found; set HOROVOD_NCCL_HOME to an NCCL install)")
    return missing


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


def patch_cuda_standard(source: Path) -> None:
    """Horovod compiles its CUDA kernels as C++11; CUDA 13 needs C++17 at least."""
    cmake = source / "horovod" / "common" / "ops" / "cuda" / "CMakeLists.txt"
    text = cmake.read_text()
    if "set(CMAKE_CUDA_STANDARD 11)" not in text:
        raise RuntimeError(f"{cmake}: no CUDA standard setting to patch; is this Horovod {VERSION}?")
    cmake.write_text(text.replace("set(CMAKE_CUDA_STANDARD 11)", "set(CMAKE_CUDA_STANDARD 17)"))


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


def sdist(source_dir: Path | None, into: Path) -> Path:
    """Horovod's sdist: from ``source_dir`` (offline) or downloaded from the package registry."""
    if source_dir is None:
        _pip("download", "--no-deps", "--no-binary", ":all:", f"horovod=={VERSION}", "-d", str(into))
        source_dir = into
    found = sorted(source_dir.glob(f"horovod-{VERSION}.tar.gz"))
    if not found:
        raise FileNotFoundError(
            f"no horovod-{VERSION}.tar.gz in {source_dir}; fetch it where the registry is reachable with "
            f"`python -m lightning_spatial.install_horovod --download {source_dir}`"
        )
    return found[0]


def build_wheel(gpu: bool, source_dir: Path | None = None) -> Path:
    target = CACHE / wheel_tag()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with tarfile.open(sdist(source_dir, tmp)) as archive:
            archive.extractall(tmp, filter="data")
        source = tmp / f"horovod-{VERSION}"
        patch_cxx_standard(source, torch_cxx_standard())
        env = build_env(gpu)
        if gpu:
            patch_cuda_standard(source)
            if "HOROVOD_NCCL_HOME" not in env:
                env.update(torch_nccl(tmp))
        else:
            patch_cpu_only(source)
        missing = missing_prerequisites(gpu, env)
        if missing:
            raise RuntimeError("cannot build Horovod here; missing: " + "; ".join(missing))
        if shutil.which("cmake") is None:
            _pip("install", *_offline(source_dir), "cmake")
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
                source,
            ],
            check=True,
            env=env,
        )
        target.mkdir(parents=True, exist_ok=True)
        wheel = next((tmp / "dist").glob("horovod-*.whl"))
        shutil.copy(wheel, target / wheel.name)
    return target / wheel.name


def _offline(source_dir: Path | None) -> list[str]:
    return ["--no-index", "--find-links", str(source_dir)] if source_dir else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    parser.add_argument("--from", dest="source", type=Path, help="offline: the sdist and runtime wheels are in DIR")
    parser.add_argument("--download", type=Path, help="fetch the sdist and runtime wheels into DIR, then stop")
    args = parser.parse_args(argv)
    if args.download:
        _pip("download", "--no-deps", "--no-binary", ":all:", f"horovod=={VERSION}", "-d", str(args.download))
        _pip("download", "--only-binary", ":all:", *RUNTIME_DEPS, "-d", str(args.download))
        return 0
    import torch

    _pip("install", "-q", *_offline(args.source), *RUNTIME_DEPS)
    cached = sorted((CACHE / wheel_tag()).glob("horovod-*.whl"))
    wheel = cached[-1] if cached and not args.force else build_wheel(torch.cuda.is_available(), args.source)
    _pip("install", "-q", "--no-deps", "--force-reinstall", str(wheel))
    check = (
        "import horovod, horovod.torch as hvd; hvd.init(); "
        "print('horovod', horovod.__version__, 'gloo', hvd.gloo_built(), 'nccl', hvd.nccl_built())"
    )
    subprocess.run([sys.executable, "-c", check], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
