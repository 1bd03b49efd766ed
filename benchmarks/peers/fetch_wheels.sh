#!/usr/bin/env bash
# What the DeepSpeed peers need on a GPU machine without registry access (Python 3.12, x86-64):
# DeepSpeed's source release (its ops are not built: DS_BUILD_OPS=0) and the pure-Python wheels
# it needs beyond torch. Usage: bash benchmarks/peers/fetch_wheels.sh DEST (an ignored folder, e.g.
# .peers/wheels), then WHEELS=DEST bash benchmarks/peers/run_peers.sh on that machine.
set -eu
dest=${1:?destination folder}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" hjson pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$dest" "deepspeed==0.19.8"
ls "$dest"
