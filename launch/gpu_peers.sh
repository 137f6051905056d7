#!/usr/bin/env bash
# Source on a GPU machine without network: installs the peers' wheels carried in .whl/ (and a
# wheel too large for one transfer as parts `NAME.whl.part.*`, in .whl/ or .whl2/, which may
# arrive in separate calls: parts are kept in /tmp/peer-wheels until all are there) into
# /tmp/site, and puts it and the CUTLASS DSL's `cutlass` package (which its wheel puts on
# sys.path through a .pth file, not read from a --target folder) on PYTHONPATH.
# The wheels are fetched on a machine with PyPI, for the GPU machine's Python (3.12 there):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl liger-kernel cut-cross-entropy quack-kernels \
#     nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
#     nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext
# (the CUTLASS DSL at 4.8.1: libs-core holds the `cutlass` package itself, cutlass.cutlass_dsl
# included, under nvidia_cutlass_dsl/dsl_packages; QuACK and Liger's CuTe kernels import it)
# and a wheel over the transfer's size limit is split (split -b 46m X.whl X.whl.part.).
mkdir -p /tmp/peer-wheels /tmp/site
for dir in .whl .whl2; do
  [ -d "$dir" ] && cp -n "$dir"/* /tmp/peer-wheels/ 2>/dev/null
done
for first in /tmp/peer-wheels/*.whl.part.aa; do
  [ -e "$first" ] || continue
  whole=${first%.part.aa}
  parts=("$whole".part.*)
  # the last part is the one shorter than the first (split -b): complete when one is
  last=${parts[-1]}
  if [ "$(stat -c %s "$last")" -lt "$(stat -c %s "$first")" ]; then
    cat "${parts[@]}" > "$whole" && rm -f "${parts[@]}"
  fi
done
wheels=(/tmp/peer-wheels/*.whl)
if [ -e "${wheels[0]}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" 2>&1 | grep -v "already exists" | head -5
fi
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
echo "peers installed: $(ls /tmp/site | grep -ciE 'dist-info$') wheels in /tmp/site"
