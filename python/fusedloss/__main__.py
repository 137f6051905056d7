"""Where the C++ SDK inside this package lives, for C++ builds against the wheel:

    cmake -DCMAKE_PREFIX_PATH=$(python -m fusedloss --cmake-dir) ...   # then find_package(fusedloss)
    python -m fusedloss --include-dir                                     # -I for other build tools
"""
import argparse
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fusedloss", description=__doc__.splitlines()[0])
    ap.add_argument("--cmake-dir", action="store_true",
                    help="the directory of fusedlossConfig.cmake (for CMAKE_PREFIX_PATH or fusedloss_DIR)")
    ap.add_argument("--include-dir", action="store_true", help="the C++ headers' directory")
    ap.add_argument("--lib-dir", action="store_true", help="the directory of libfusedloss.a")
    ap.add_argument("--version", action="store_true", help="the package version")
    args = ap.parse_args(argv)
    lines = []
    if args.version:
        from importlib.metadata import version
        lines.append(version("fusedloss"))
    if args.cmake_dir:
        lines.append(os.path.join(_here, "lib", "cmake", "fusedloss"))
    if args.include_dir:
        lines.append(os.path.join(_here, "include"))
    if args.lib_dir:
        lines.append(os.path.join(_here, "lib"))
    if not lines:
        ap.print_help()
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
