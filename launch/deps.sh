#!/usr/bin/env bash
# Installs the system packages the build needs (Debian/Ubuntu): a C++ toolchain, CMake,
# Ninja, Open MPI, GoogleTest, OpenBLAS (the CPU backend's GEMMs), oneDNN (its bf16 GEMMs where
# the CPU has bf16 dot products; Debian's CMake package of it asks for OpenCL's,
# ocl-icd-opencl-dev), and Python's venv and headers (the launch scripts' .venv, the extension's
# build). The CUDA toolkit and NCCL are used when
# present. OpenBLAS in its OpenMP build (libopenblas-openmp-dev, which satisfies
# libopenblas-dev): it runs on the CPU backend's OpenMP threads, where the default pthreads
# build would keep a second pool of threads beside them.
set -euo pipefail
pkgs=(build-essential cmake ninja-build libopenmpi-dev openmpi-bin libgtest-dev
      libopenblas-openmp-dev libopenblas-dev libdnnl-dev ocl-icd-opencl-dev python3-venv python3-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
