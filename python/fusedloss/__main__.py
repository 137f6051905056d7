"""What this fusedloss build has, and where its C++ SDK lives, for C++ builds against the wheel:

    python -m fusedloss --info                 backends (CPU and its GEMMs' BLAS, CUDA and its
                                               architectures), communicators (NCCL, MPI), the
                                               SDK's paths
    cmake -DCMAKE_PREFIX_PATH=$(python -m fusedloss --cmake-prefix-path) ...   # then find_package(fusedloss)
    cmake -Dfusedloss_DIR=$(python -m fusedloss --cmake-dir) ...               # the same package
    python -m fusedloss --include-dir          -I for other build tools

--cmake-prefix-path is the package directory, the SDK's install prefix (include/, lib/,
lib/cmake/fusedloss/); --cmake-dir is the folder of fusedlossConfig.cmake inside it. They are
fusedloss.cmake_prefix_path and fusedloss.cmake_dir in Python.
"""
import argparse
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_BUILD_INFO = os.path.join(_here, "build_info.json")


def read_build_info():
    """The build's description that CMake wrote into the package (fusedloss.build_info())."""
    try:
        with open(_BUILD_INFO) as f:
            return json.load(f)
    except OSError as error:
        raise RuntimeError(f"fusedloss: {_BUILD_INFO}: {error.strerror}; the package was not installed "
                           "by its build (pip install .)") from None


def _yes(flag):
    return "yes" if flag else "no"


def _cpu_gemms(info):
    """The CPU backend's GEMMs: the BLAS linked (the file behind a distribution's alternatives
    link too, which names its variant, e.g. openblas-openmp), or the plain loops."""
    if not info.get("cpu_blas"):
        return "plain loops (built without a BLAS)"
    libs = []
    for lib in info.get("blas_libraries", []):
        real = os.path.realpath(lib)
        libs.append(lib if real == lib else f"{lib} -> {real}")
    gemms = "BLAS: " + (", ".join(libs) or "the linker's default")
    if info.get("cpu_bf16_dnnl"):
        gemms += f"; bf16 through oneDNN {info.get('dnnl_version', '')} where the CPU has bf16 dot products"
    return gemms


def info_lines():
    info = read_build_info()
    cuda = info["backends"]["CUDA"]
    comms = info["communicators"]
    lines = [f"fusedloss {info['version']} ({_here})", "backends:"]
    threads = "OpenMP threads" if info.get("openmp") else "one thread"
    lines.append(f"  CPU   yes ({threads}; GEMMs through {_cpu_gemms(info)})")
    if cuda:
        archs = ", ".join(f"sm_{a}" if a[:1].isdigit() else a for a in info["cuda_architectures"])
        lines.append(f"  CUDA  yes (CUDA {info['cuda_version']}; kernels for {archs or 'the default architectures'})")
    else:
        lines.append("  CUDA  no (built without nvcc: CUDA tensors are refused)")
    lines.append("communicators of the C++ SDK:")
    for name in ("NCCL", "MPI"):
        header = "fusedloss/comm_nccl.h" if name == "NCCL" else "fusedloss/comm_mpi.h"
        lines.append(f"  {name:5} {'yes (' + header + ')' if comms[name] else 'no (its header is not installed)'}")
    lines.append("  (the PyTorch ops run vocab-parallel over any torch.distributed group, whatever these say;")
    lines.append("   a C++ trainer can implement fusedloss::Communicator over its own collectives)")
    lines.append("C++ SDK:")
    lines.append(f"  CMAKE_PREFIX_PATH  {_here}")
    lines.append(f"  fusedloss_DIR      {os.path.join(_here, 'lib', 'cmake', 'fusedloss')}")
    lines.append(f"  include            {os.path.join(_here, 'include')}")
    if cuda:
        cpu = "find_package(fusedloss COMPONENTS CPU) (no CUDA toolkit needed)" if info.get("cpu_library") else "no"
        lines.append(f"  CPU backend alone  {cpu}")
    try:  # what this process sees: torch, a GPU, the C++ autograd nodes
        import torch
        from . import _native
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
        lines.append(f"torch {torch.__version__}, GPU: {gpu}")
        lines.append(f"C++ autograd nodes: {_native.status}")
    except Exception as error:  # noqa: BLE001 - --info reports, it does not fail
        lines.append(f"torch: not importable here ({type(error).__name__}: {error})")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fusedloss", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--info", action="store_true",
                    help="what this build has: backends (CPU, CUDA + architectures), communicators "
                         "(NCCL, MPI), the SDK's paths, and what this process sees")
    ap.add_argument("--cmake-prefix-path", action="store_true",
                    help="the SDK's install prefix, for CMAKE_PREFIX_PATH (fusedloss.cmake_prefix_path)")
    ap.add_argument("--cmake-dir", action="store_true",
                    help="the folder of fusedlossConfig.cmake, for fusedloss_DIR (fusedloss.cmake_dir)")
    ap.add_argument("--include-dir", action="store_true", help="the C++ headers' directory")
    ap.add_argument("--lib-dir", action="store_true", help="the directory of libfusedloss.a")
    ap.add_argument("--version", action="store_true", help="the package version")
    args = ap.parse_args(argv)
    lines = []
    if args.version:
        lines.append(read_build_info()["version"])
    if args.cmake_prefix_path:
        lines.append(_here)
    if args.cmake_dir:
        lines.append(os.path.join(_here, "lib", "cmake", "fusedloss"))
    if args.include_dir:
        lines.append(os.path.join(_here, "include"))
    if args.lib_dir:
        lines.append(os.path.join(_here, "lib"))
    if args.info:
        lines += info_lines()
    if not lines:
        ap.print_help()
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
