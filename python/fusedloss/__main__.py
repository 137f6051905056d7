"""Where the C++ SDK inside this package lives, for C++ builds against the wheel:

    cmake -DCMAKE_PREFIX_PATH=$(python -m fusedloss --cmake-prefix-path) ...   # then find_package(fusedloss)
    cmake -Dfusedloss_DIR=$(python -m fusedloss --cmake-dir) ...               # the same package
    python -m fusedloss --include-dir          -I for other build tools

--cmake-prefix-path is the package directory, the SDK's install prefix (include/, lib/,
lib/cmake/fusedloss/); --cmake-dir is the folder of fusedlossConfig.cmake inside it. They are
fusedloss.cmake_prefix_path and fusedloss.cmake_dir in Python.
"""
import argparse
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fusedloss", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
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
        from importlib.metadata import version
        lines.append(version("fusedloss"))
    if args.cmake_prefix_path:
        lines.append(_here)
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
