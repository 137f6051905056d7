"""The installed fusedloss distribution (its RECORD, i.e. the wheel's file list) holds nothing
outside the fusedloss/ package and its .dist-info, ships the C++ SDK inside the package, ships
the headers of what was built and no others (a communicator's header without its implementation
would compile and fail to link), and carries its license."""
import json
import sys
from importlib.metadata import distribution

dist = distribution("fusedloss")
files = [str(f) for f in dist.files]
info = f"fusedloss-{dist.version}.dist-info/"
outside = [f for f in files if not (f.startswith("fusedloss/") or f.startswith(info))]
needed = ["fusedloss/include/fusedloss/fusedloss.h", "fusedloss/include/fusedloss/config.h",
          "fusedloss/lib/libfusedloss.a", "fusedloss/lib/cmake/fusedloss/fusedlossConfig.cmake",
          "fusedloss/lib/cmake/fusedloss/fusedlossConfigVersion.cmake",
          "fusedloss/lib/cmake/fusedloss/fusedlossTargets.cmake", "fusedloss/__main__.py",
          "fusedloss/build_info.json", info + "licenses/LICENSE",
          # the C++ autograd nodes: launch/python.sh builds against the environment's torch
          "fusedloss/libfusedloss_torch.so", "fusedloss/torch_nodes_version.txt"]
with open(dist.locate_file("fusedloss/build_info.json")) as f:
    build = json.load(f)
comms = build["communicators"]
headers = {"fusedloss/include/fusedloss/comm_nccl.h": comms["NCCL"],
           "fusedloss/include/fusedloss/comm_mpi.h": comms["MPI"],
           "fusedloss/include/fusedloss/nccl_bootstrap.h": comms["NCCL"] and comms["MPI"]}
if build["backends"]["CUDA"]:  # the CPU backend alone, for consumers without the CUDA toolkit
    needed += ["fusedloss/lib/libfusedloss_cpu.a", "fusedloss/lib/cmake/fusedloss/fusedlossCpuTargets.cmake"]
needed += [h for h, built in headers.items() if built]
unbuilt = [h for h, built in headers.items() if not built and h in files]
missing = [f for f in needed if f not in files]
for f in outside:
    print(f"outside the package: {f}")
for f in missing:
    print(f"missing from the package: {f}")
for f in unbuilt:
    print(f"a header of what this build lacks: {f}")
print(f"wheel files: {len(files)}, outside fusedloss/ and {info}: {len(outside)}, "
      f"C++ SDK files missing: {len(missing)}, headers of what was not built: {len(unbuilt)}")
sys.exit(1 if outside or missing or unbuilt else 0)
