#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute) for the benchmarks' fa4 column on a GPU
# machine without network. Its CUDA 13 library wheel (nvidia-cutlass-dsl-libs-cu13)
# is larger than one device call may carry, so it travels as parts.
#
#   bash scripts/fa4_wheels.sh pack            # here: .carry/fa4/{wheels,part.0,part.1}
#   bash scripts/fa4_wheels.sh stash PART...    # there: keep carried parts in /tmp/fa4parts
#   bash scripts/fa4_wheels.sh install          # there: join, install to /tmp/fa4site
#
# Then `source /tmp/fa4site/env.sh` makes `import flash_attn.cute` work (PYTHONPATH
# holds the site and the folder nvidia_cutlass_dsl's .pth file would add).
# Packages the GPU machine's image already holds (torch, einops, cuda-bindings,
# typing_extensions) are not packed.
set -euo pipefail
cd "$(dirname "$0")/.."
FA4_VERSION=${FA4_VERSION:-4.0.0b36}
DSL_VERSION=${DSL_VERSION:-4.8.1}
case "${1:-}" in
pack)
  dir=.carry/fa4 && rm -rf "$dir" && mkdir -p "$dir/wheels" /tmp/fa4dl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    -d /tmp/fa4dl "flash-attn-4==$FA4_VERSION" "nvidia-cutlass-dsl==$DSL_VERSION" \
    "nvidia-cutlass-dsl-libs-base==$DSL_VERSION" "nvidia-cutlass-dsl-libs-core==$DSL_VERSION" \
    "nvidia-cutlass-dsl-libs-cu13==$DSL_VERSION" apache-tvm-ffi==0.1.15.post2 quack-kernels==0.6.5 \
    torch-c-dlpack-ext==0.1.5
  for w in /tmp/fa4dl/*.whl; do
    [[ $w == *libs_cu13* ]] || cp "$w" "$dir/wheels/"
  done
  # The wheel's zip compresses its two large libraries poorly; xz of the
  # unpacked tree is a third smaller, then split in two.
  rm -rf /tmp/fa4cu13 && mkdir /tmp/fa4cu13 && (cd /tmp/fa4cu13 && unzip -q /tmp/fa4dl/*libs_cu13*.whl)
  tar cf - -C /tmp/fa4cu13 . | xz -T2 -9e | split -b 33M -d -a 1 - "$dir/part."
  du -sh "$dir"/*
  ;;
stash)
  shift && mkdir -p /tmp/fa4parts && cp -r "$@" /tmp/fa4parts/ && ls -la /tmp/fa4parts
  ;;
install)
  rm -rf /tmp/fa4site && mkdir -p /tmp/fa4site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4site /tmp/fa4parts/wheels/*.whl
  cat /tmp/fa4parts/part.* | xz -d | tar xf - -C /tmp/fa4site
  echo 'export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}' \
    >/tmp/fa4site/env.sh
  # shellcheck disable=SC1091
  source /tmp/fa4site/env.sh && python3 -c "import flash_attn.cute as c; print('fa4', c.__file__)"
  ;;
*)
  echo "usage: $0 pack | stash PART... | install" >&2 && exit 2
  ;;
esac
