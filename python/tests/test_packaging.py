"""The installed package as a newcomer meets it: one version everywhere (fusedloss.__version__,
the distribution, the C++ SDK's CMake package and config.h, CMakeLists.txt's project()), the
SDK's paths (python -m fusedloss and the module attributes agree), what the build has
(python -m fusedloss --info, the headers installed), the license and the description."""
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import metadata, version

import pytest

import fusedloss

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _cli(*args):
    out = subprocess.run([sys.executable, "-m", "fusedloss", *args], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_one_version_everywhere():
    v = fusedloss.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", v), v
    assert version("fusedloss") == v
    assert fusedloss.build_info()["version"] == v
    assert _cli("--version") == v
    with open(os.path.join(fusedloss.cmake_dir, "fusedlossConfigVersion.cmake")) as f:
        assert re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', f.read()).group(1) == v
    with open(os.path.join(fusedloss.cmake_prefix_path, "include", "fusedloss", "config.h")) as f:
        assert re.search(r'#define FUSEDLOSS_VERSION "([^"]+)"', f.read()).group(1) == v
    cmakelists = os.path.join(REPO, "CMakeLists.txt")
    if os.path.exists(cmakelists):  # the sources this package was built from
        with open(cmakelists) as f:
            assert re.search(r"project\(fusedloss VERSION ([0-9.]+)", f.read()).group(1) == v, \
                "CMakeLists.txt's version differs from the installed package's: reinstall (pip install .)"


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                    reason="needs cmake and a C++ compiler")
def test_find_package_reports_the_same_version(tmp_path):
    """What a CMake consumer sees: find_package(fusedloss) sets fusedloss_VERSION (the CPU
    component: no CUDA toolkit needed to configure)."""
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.24)\nproject(probe LANGUAGES CXX)\n"
        "find_package(fusedloss REQUIRED COMPONENTS CPU)\n"
        'message(STATUS "fusedloss_VERSION=${fusedloss_VERSION}")\n')
    out = subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "build"),
                          f"-DCMAKE_PREFIX_PATH={fusedloss.cmake_prefix_path}"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"fusedloss_VERSION={fusedloss.__version__}" in out.stdout


def test_cmake_paths_agree():
    prefix, config_dir = fusedloss.cmake_prefix_path, fusedloss.cmake_dir
    assert _cli("--cmake-prefix-path") == prefix
    assert _cli("--cmake-dir") == config_dir
    assert config_dir == os.path.join(prefix, "lib", "cmake", "fusedloss")
    assert os.path.isfile(os.path.join(config_dir, "fusedlossConfig.cmake"))
    assert _cli("--include-dir") == os.path.join(prefix, "include")
    assert os.path.isfile(os.path.join(prefix, "include", "fusedloss", "fusedloss.h"))
    assert os.path.isfile(os.path.join(_cli("--lib-dir"), "libfusedloss.a"))


def test_info_says_what_the_build_has():
    info = fusedloss.build_info()
    assert info["backends"]["CPU"] is True
    text = _cli("--info")
    assert f"fusedloss {fusedloss.__version__}" in text
    cuda_line = next(line for line in text.splitlines() if line.strip().startswith("CUDA "))
    assert ("yes" if info["backends"]["CUDA"] else "no") in cuda_line
    for arch in info["cuda_architectures"]:
        assert f"sm_{arch}" in cuda_line or arch in cuda_line
    include = os.path.join(fusedloss.cmake_prefix_path, "include", "fusedloss")
    for name, header in (("NCCL", "comm_nccl.h"), ("MPI", "comm_mpi.h")):
        built = info["communicators"][name]
        line = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
        assert line.split()[1] == ("yes" if built else "no"), line
        # the SDK ships the header of a communicator only where the library has it
        assert os.path.exists(os.path.join(include, header)) == built, header
    if info["backends"]["CUDA"]:
        assert info["cpu_library"] is True  # fusedloss::cpu for consumers without the CUDA toolkit
        assert os.path.isfile(os.path.join(fusedloss.cmake_dir, "fusedlossCpuTargets.cmake"))


def test_build_info_is_json_with_every_field():
    with open(os.path.join(fusedloss.cmake_prefix_path, "build_info.json")) as f:
        info = json.load(f)
    assert set(info) >= {"version", "backends", "cuda_version", "cuda_architectures", "openmp",
                         "communicators", "cpu_library"}


def test_distribution_metadata():
    meta = metadata("fusedloss")
    summary = meta["Summary"].lower()
    for op in ("cross-entropy", "linear cross-entropy", "swiglu", "rmsnorm"):
        assert op in summary, (op, summary)
    assert meta["License-Expression"] == "Apache-2.0"
    megatron = [r for r in meta.get_all("Requires-Dist") if r.startswith("megatron-core")]
    # installable on Python 3.11, whose newest megatron-core is 0.16
    assert megatron and all(re.search(r">=0\.1[0-6]\b", r) for r in megatron), megatron


def test_the_package_modules_import_no_circle():
    """No module of the package imports one that imports it back, at the top or inside a
    function (a circle only works for the import order that happens to run first)."""
    import ast
    import pathlib
    root = pathlib.Path(fusedloss.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        package = parts[:-1] if parts[-1] != "__init__" else parts
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = list(package[:len(package) - (node.level - 1)])
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [mod] if node.module else [".".join(base + [a.name]) for a in node.names]
                edges.update(t.strip(".") for t in targets)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusedloss."):
                edges.add(node.module[len("fusedloss."):])
        graph[name] = edges
    seen, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
        if n in seen or n not in graph:
            return
        stack.append(n)
        for m in sorted(graph[n]):
            if m != n and not n.startswith(m + "."):  # a package's own __init__ is no circle
                visit(m)
        stack.pop()
        seen.add(n)

    for n in sorted(graph):
        visit(n)
