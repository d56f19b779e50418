"""The Horovod build's preparation, without building: offline sources, torch's NCCL, named prerequisites."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_spatial import install_horovod as ih


def test_offline_build_without_the_sdist_says_how_to_fetch_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no horovod-{ih.VERSION}.tar.gz in .* --download {tmp_path}"):
        ih.sdist(tmp_path, tmp_path)


def test_offline_build_takes_the_sdist_from_the_folder(tmp_path):
    (tmp_path / f"horovod-{ih.VERSION}.tar.gz").write_bytes(b"")
    assert ih.sdist(tmp_path, tmp_path / "unused") == tmp_path / f"horovod-{ih.VERSION}.tar.gz"


@pytest.mark.skipif(importlib.util.find_spec("nvidia.nccl") is None, reason="torch was installed without NCCL")
def test_nccl_comes_from_torchs_wheel_with_a_linkable_name(tmp_path):
    env = ih.torch_nccl(tmp_path)
    assert (Path(env["HOROVOD_NCCL_INCLUDE"]) / "nccl.h").exists()
    lib = Path(env["HOROVOD_NCCL_LIB"]) / "libnccl.so"  # what CMake's find_library(nccl) looks for
    assert lib.is_symlink() and lib.resolve().name.startswith("libnccl.so.") and lib.resolve().exists()
    assert env["HOROVOD_NCCL_LINK"] == "SHARED"


def test_missing_build_tools_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(ih.shutil, "which", lambda name: None)
    monkeypatch.setattr(ih.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    missing = " ".join(ih.missing_prerequisites(False, {}))
    assert "C++ compiler" in missing and "make" in missing and "Python headers" in missing


def test_gpu_build_without_nccl_is_named():
    missing = " ".join(ih.missing_prerequisites(True, {}))
    assert "NCCL" in missing


def test_cuda_kernels_are_patched_to_cxx17(tmp_path):
    cmake = tmp_path / "horovod" / "common" / "ops" / "cuda" / "CMakeLists.txt"
    cmake.parent.mkdir(parents=True)
    cmake.write_text("set(CMAKE_CUDA_STANDARD 11)\n")
    ih.patch_cuda_standard(tmp_path)
    assert cmake.read_text() == "set(CMAKE_CUDA_STANDARD 17)\n"
