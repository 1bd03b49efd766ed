#!/usr/bin/env bash
# The peer baselines of BENCHMARKS.md on one GPU node, one JSON line per run (tokens/s per GPU,
# TFLOP/s, MFU against 989 TFLOP/s, step time, peak memory). Run from anywhere:
#   MODES="plain ddp fsdp2 ds1 ds2 ds3 tp pp-1f1b pp-interleaved pp-zbv" SIZE=1.3b MBS=8 NPROC=2 \
#     bash benchmarks/peers/run_peers.sh
#   MODES="tp2-dp pp2-dp tp2-pp2" NPROC=4 bash benchmarks/peers/run_peers.sh   # two axes (composed_parallel.py):
#     tpN and ppN name the axes, dp (or dpN) takes the rest of NPROC
# DeepSpeed (ds*) must be importable; on a machine without registry access set WHEELS to a folder
# made by fetch_wheels.sh and it is installed first (into /tmp/peer-site). DDP, FSDP2, tp and pp
# run compiled; plain runs eager and compiled. PORT sets torchrun's master port (default 29511), so
# two sets of GPUs on one machine can run at once.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
size=${SIZE:-1.3b} mbs=${MBS:-8} nproc=${NPROC:-2}

install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer-site "$WHEELS"/*.whl \
    || return 1
  export PYTHONPATH=/tmp/peer-site${PYTHONPATH:+:$PYTHONPATH}
  local src
  src=$(ls "$WHEELS"/deepspeed-*.tar.gz 2>/dev/null | head -1)
  [ -n "$src" ] || return 0
  rm -rf /tmp/ds-src && mkdir -p /tmp/ds-src && tar xzf "$src" -C /tmp/ds-src
  (cd /tmp/ds-src/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --target /tmp/peer-site . >/tmp/ds-install.log 2>&1) || tail -20 /tmp/ds-install.log
}

distributed() {  # torchrun SCRIPT ARGS...: the JSON line, or the error
  timeout 300 torchrun --nproc-per-node "$nproc" --master-port "${PORT:-29511}" "$here/$1" "${@:2}" --size "$size" \
    --micro-batch "$mbs" 2>&1 | grep -E '^\{|Error|error:' | head -5
}

[ -z "${WHEELS:-}" ] || install_wheels || exit 1
for mode in ${MODES:-plain ddp fsdp2 ds1 ds2 ds3}; do
  case $mode in
    plain) timeout 300 python3 "$here/single_gpu.py" --sizes "$size" --micro-batches "$mbs" 2>&1 | grep -E '^\{|Error' ;;
    ddp|fsdp2) distributed data_parallel.py --mode "$mode" --compile ;;
    ds1|ds2|ds3) distributed data_parallel.py --mode "$mode" ;;
    tp) distributed tensor_parallel.py --compile ;;
    pp-zbv) distributed pipeline_parallel.py --schedule zbv ;;
    pp-*) distributed pipeline_parallel.py --schedule "${mode#pp-}" --compile ;;
    tp[0-9]*|pp[0-9]*)  # tp2-dp, pp2-dp, tp2-pp2: the composed peer, tpN and ppN from the name
      axes=$(echo "$mode" | sed -E 's/-dp[0-9]*$//; s/-/ /g; s/(tp|pp)([0-9]+)/--\1 \2/g')
      distributed composed_parallel.py $axes --compile ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done
