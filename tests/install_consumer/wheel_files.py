"""The installed fusedloss distribution (its RECORD, i.e. the wheel's file list) holds nothing
outside the fusedloss/ package and its .dist-info, and ships the C++ SDK inside the package."""
import sys
from importlib.metadata import distribution

dist = distribution("fusedloss")
files = [str(f) for f in dist.files]
info = f"fusedloss-{dist.version}.dist-info/"
outside = [f for f in files if not (f.startswith("fusedloss/") or f.startswith(info))]
needed = ["fusedloss/include/fusedloss/fusedloss.h", "fusedloss/include/fusedloss/config.h",
          "fusedloss/lib/libfusedloss.a", "fusedloss/lib/cmake/fusedloss/fusedlossConfig.cmake",
          "fusedloss/lib/cmake/fusedloss/fusedlossTargets.cmake", "fusedloss/__main__.py",
          # the C++ autograd nodes: launch/python.sh builds against the environment's torch
          "fusedloss/libfusedloss_torch.so", "fusedloss/torch_nodes_version.txt"]
missing = [f for f in needed if f not in files]
for f in outside:
    print(f"outside the package: {f}")
for f in missing:
    print(f"missing from the package: {f}")
print(f"wheel files: {len(files)}, outside fusedloss/ and {info}: {len(outside)}, "
      f"C++ SDK files missing: {len(missing)}")
sys.exit(1 if outside or missing else 0)
