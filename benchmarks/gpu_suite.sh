#!/usr/bin/env bash
# GPU benchmark suite on one node (2 GPUs unless a part says otherwise), in parts that each fit a 10-minute call:
#   benchmarks/gpu_suite.sh zero     megazero ZeRO stages 0-3 (+ stage 3 offload) and DDP / FSDP2 peers
#                                    (RUNS overrides the megazero runs, e.g. "stage1 stage1-compile";
#                                    PROFILE=1 adds each run's kernel table to $OUT)
#   benchmarks/gpu_suite.sh ds       DeepSpeed ZeRO-1/2/3 peers (PEERS/WHEELS as in the peers' README)
#   benchmarks/gpu_suite.sh layers   tensor- and pipeline-parallel benchmarks
#   benchmarks/gpu_suite.sh trainer  scripts/pretrain_gpt.sh with a 1.3B GPT on 1 and 2 GPUs
#   benchmarks/gpu_suite.sh axes     tp 2 and pp 2 (1F1B, zero-bubble) against one GPU, with compiled
#                                    blocks (tp 2 at the defaults: peer memory in CUDA-graph blocks since
#                                    2026-11-30, NCCL without graphs before), beside the torch-native and megatron-core peers (the
#                                    megatron-core wheel in $WHEELS); PROFILE=1 adds tp 2's kernel table
#   benchmarks/gpu_suite.sh tpdiag   what bounds tp 2 + sequence parallel (0.80 of one GPU on H200 in every
#                                    communication mode): each mode, the per-bucket partial sums moved after
#                                    backward (nooverlap), NCCL's Simple protocol, micro-batch 4, each twice,
#                                    interleaved, beside one GPU at both sizes (about 9 minutes)
#   benchmarks/gpu_suite.sh graphs   train.cuda_graphs against plain compiled blocks: one GPU, then tp 2 + sp at
#                                    micro-batches 4 and 8 (overlap, serial: NCCL), every run the first of its
#                                    process and plain/graphs interleaved, so losses compare one to one
#                                    (about 9 minutes)
#   benchmarks/gpu_suite.sh pairs    four GPUs as two pairs running at once (0,1 and 2,3), swapped between rounds: tp 2
#                                    + sp plain against CUDA-graph blocks at micro-batches 4 and 8, and NCCL's
#                                    high-priority streams (TORCH_NCCL_HIGH_PRIORITY=1) against the default
#                                    (about 8 minutes)
#   benchmarks/gpu_suite.sh ctas     tp 2 + sp at micro-batch 8 with CUDA-graph blocks, NCCL limited to 4, 8 and 16
#                                    thread blocks (NCCL_MAX_CTAS) against its default: whether collectives that
#                                    take fewer multiprocessors hide behind the GEMMs (about 5 minutes)
#   benchmarks/gpu_suite.sh gradcopy one GPU: the ways bf16 gradients can land in the fp32 buffer (about 1 minute)
#   benchmarks/gpu_suite.sh optimizer one GPU: the one-pass AdamW kernel per tile size against torch's fused AdamW
#                                    and the rounding copy, then the whole optimizer step at 125M and 1.3B with
#                                    the kernel and without, and at 125M where the host's time goes (about 3 minutes)
#   benchmarks/gpu_suite.sh hostbound one GPU each, 125M and 350M: the user's path (steps_ahead 1 and 2, with
#                                    the host's wait per step) against the engine alone (train_gpu.py, no reads
#                                    until the end) on the same GPU, and the plain peer; then a profile of
#                                    three trainer steps at 350M (logging.profile_steps) (about 8 minutes)
#   benchmarks/gpu_suite.sh trainergap one GPU, GPT 1.3B: the user's path against the engine alone (train_gpu.py),
#                                    both on the demo corpus's text at the peers' learning rate, each timed,
#                                    then each profiled over three steps on the same GPU (about 5 minutes);
#                                    at different learning rates the two ran at different clocks (BENCHMARKS.md)
#   benchmarks/gpu_suite.sh eight    eight GPUs, the user's path: the 1.3B GPT for 20 steps on the demo corpus
#                                    on one GPU, then tp 2 x pp 2 x dp 2 (ZeRO 1 and 3), tp 8 and dp 8 (ZeRO 3);
#                                    benchmarks/loss_curves.py checks each against the one-GPU losses (2%) and
#                                    gives its tokens/s, MFU and peak memory
#   benchmarks/gpu_suite.sh eight-speed  eight GPUs: those layouts' throughput beside one GPU, DDP and FSDP2 at
#                                    dp 8, and megatron-core at tp 2 x pp 2 x dp 2 (SIZE=6.7b for the large model)
#   benchmarks/gpu_suite.sh halves   four GPUs: half-block pipeline splits where whole blocks leave a stage furthest
#                                    above the mean (docs/pipeline.md): the 6.7B GPT at tp 2 x pp 2, [16, 16]
#                                    against [16.5, 15.5] (predicted 2.3% faster), and the 1.3B GPT at pp 4,
#                                    [6, 7, 6, 5] against [6.5, 6.5, 6.5, 4.5] (predicted 6.5%), with one GPU
#   benchmarks/gpu_suite.sh axes4    four GPUs: tp 2 x dp 2, pp 2 x dp 2 (1F1B, zero-bubble) and tp 2 x pp 2
#                                    for the 1.3B GPT against one GPU, megatron-core and the composed torch
#                                    peer (peers/composed_parallel.py) at the same layouts,
#                                    then the 6.7B GPT (configs/gpt_6.7b.yaml) at tp 2 x dp 2 and tp 2 x pp 2
# Output: JSON lines on stdout (and in $OUT/PART.log when OUT is set).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
part=${1:?part: zero, ds, layers, trainer, axes, tpdiag, graphs, pairs, ctas, gradcopy, optimizer, hostbound, trainergap, halves, axes4, eight or eight-speed}
log=${OUT:-/tmp}/$part.log
PEERS=${PEERS:-benchmarks/peers}
run() { echo "## $*" >&2; "$@" 2>&1 | tee -a "$log" | grep -E '^\{|^step |^megazero|Error|error' ; }
# the traces of the newest model_sizes_gpu.py run of SIZE (its run directory is a fresh temporary one) into $OUT
copy_profile() { cp "$(ls -td "${TMPDIR:-/tmp}"/mz-$1-* | head -n 1)"/profile/*.json.gz "${OUT:-/tmp}/" 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log"
case $part in
zero)
  # one process per run, so each run's peak memory is its own
  for r in ${RUNS:-stage0 stage1 stage2 stage3 stage3-offload}; do
    run timeout 150 torchrun --nproc_per_node 2 benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs "$r" \
      --warmup 3 --steps 10 ${PROFILE:+--profile ${OUT:-/tmp}}
  done
  PEERS=$PEERS MODES="ddp fsdp2" run bash $PEERS/run_peers.sh ;;
ds)
  PEERS=$PEERS WHEELS=${WHEELS:-.peers/wheels} MODES="ds1 ds2 ds3" run bash $PEERS/run_peers.sh ;;
layers)
  run timeout 200 torchrun --nproc_per_node 2 benchmarks/tp_gpu.py --steps 10
  run timeout 200 torchrun --nproc_per_node 2 benchmarks/pp_gpu.py --micro-batches 4 8 ;;
trainer)
  run timeout 150 torchrun --nproc_per_node 2 benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs pp2-stage1 \
    --warmup 2 --steps 5
  [ -f data/demo/stdlib_text_document.idx ] || run python -m megazero.cli demo-corpus data/demo
  for n in 1 2; do
    CONFIG=configs/gpt_1.3b.yaml NPROC_PER_NODE=$n run timeout 150 bash scripts/pretrain_gpt.sh \
      --data.blend '[[1.0, data/demo/stdlib_text_document]]' --train.train_steps 30 --logging.log_interval 10 \
      --train.global_batch_size $((8 * n)) --checkpoint.save_on_exit false --logging.run_dir runs/gpu$n
  done ;;
hostbound)
  # the user's path and the engine alone at the same sizes and micro-batches as model_sizes_gpu.py
  for size in 125m 350m; do
    case $size in 125m) shape="--model.num_layers 12 --model.hidden_size 768 --model.num_heads 12"; mbs=16;;
                  350m) shape="--model.num_layers 24 --model.hidden_size 1024 --model.num_heads 16"; mbs=8;; esac
    for ahead in 1 2; do
      run timeout 200 python benchmarks/model_sizes_gpu.py --sizes $size --runs megazero --steps 30 --skip 10 \
        --megazero-args "--train.steps_ahead $ahead"
    done
    run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs compile \
      --warmup 8 --steps 20 $shape --zero.stage 0 --train.micro_batch_size $mbs
    run timeout 150 python benchmarks/model_sizes_gpu.py --sizes $size --runs plain --steps 30 --skip 10
  done
  run timeout 200 python benchmarks/model_sizes_gpu.py --sizes 350m --runs megazero --steps 24 --skip 10 \
    --megazero-args "--logging.profile_steps [15,17]"
  copy_profile 350m ;;
trainergap)
  [ -f data/demo/stdlib_text_document.idx ] || python -m megazero.cli demo-corpus data/demo > /dev/null
  for profiled in "" 1; do
    run timeout 200 python benchmarks/model_sizes_gpu.py --sizes 1.3b --runs megazero --steps 24 --skip 10 \
      ${profiled:+--megazero-args "--logging.profile_steps [15,17]"}
    run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs stage0-compile \
      --warmup 8 --steps 16 --text data/demo/stdlib_text_document ${profiled:+--profile ${OUT:-/tmp}/engine}
  done
  copy_profile 1.3b
  for trace in "${OUT:-/tmp}"/rank0_steps15-17.json.gz "${OUT:-/tmp}"/engine/trace_stage0-compile_rank0.json.gz; do
    run python benchmarks/trace_summary.py "$trace" --steps 3 --top 25  # train_gpu.py's trace has no step ranges
  done ;;
axes)
  # one GPU: one micro-batch (tensor parallel's reference) and eight (the pipeline's)
  run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
    --runs stage1-compile stage1-m8-compile --warmup 3 --steps 5
  run timeout 200 torchrun --nproc_per_node 2 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
    --runs ${RUNS:-tp2-sp-compile pp2-m8-compile pp2-m8-zb-compile pp2-m8-zb2-compile} --warmup 3 --steps 5 ${PROFILE:+--profile ${OUT:-/tmp}}
  PEERS=$PEERS MODES="plain tp pp-1f1b" run bash $PEERS/run_peers.sh
  [ -n "${WHEELS:-}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore-site \
    "$WHEELS"/megatron_core-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/mcore-site
  for layout in "--tp 2" "--pp 2 --micro-batches 8"; do
    run timeout 200 torchrun --nproc_per_node 2 benchmarks/peers/megatron_core_gpt.py $layout
  done ;;
tpdiag)
  run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
    --runs stage1-compile stage1-mbs4-compile --warmup 3 --steps 6
  for repeat in 1 2; do
    for r in tp2-sp-overlap-compile tp2-sp-serial-compile tp2-sp-overlap-nooverlap-compile tp2-sp-mbs4-serial-compile; do
      run timeout 100 torchrun --nproc_per_node 2 benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs $r \
        --warmup 3 --steps 6
    done
    NCCL_PROTO=Simple run timeout 100 torchrun --nproc_per_node 2 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
      --runs tp2-sp-overlap-compile --warmup 3 --steps 6
  done ;;
graphs)
  run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
    --runs stage1-compile stage1-mbs4-compile --warmup 3 --steps 6
  for r in mbs4-overlap mbs4-overlap-cg mbs4-serial mbs8-overlap mbs8-overlap-cg mbs8-serial mbs8-serial-cg \
           mbs4-overlap-cg mbs4-serial mbs4-overlap; do
    run timeout 100 torchrun --nproc_per_node 2 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
      --runs tp2-sp-$r-compile --warmup 3 --steps 6
  done ;;
pairs)
  pair() {  # pair GPUS PORT RUN [ENV=VALUE]: one tp 2 run on a pair of GPUs, its lines labelled
    run env CUDA_VISIBLE_DEVICES=$1 ${4:-} timeout 110 torchrun --nproc_per_node 2 --master_port $2 \
      benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs $3 --warmup 3 --steps 6 |
      sed "s/^/[GPUs $1 ${4:-default}] /" | tee -a "$log"
  }
  hp=TORCH_NCCL_HIGH_PRIORITY=1
  pair 2,3 29601 tp2-sp-mbs4-overlap-compile; pair 2,3 29601 tp2-sp-mbs4-overlap-cg-compile
  for cg in "" cg-; do
    pair 0,1 29500 tp2-sp-overlap-${cg}compile & pair 2,3 29601 tp2-sp-overlap-${cg}compile $hp & wait
    pair 0,1 29500 tp2-sp-overlap-${cg}compile $hp & pair 2,3 29601 tp2-sp-overlap-${cg}compile & wait
  done
  pair 0,1 29500 tp2-sp-mbs4-overlap-cg-compile & pair 2,3 29601 tp2-sp-mbs4-overlap-compile $hp & wait ;;
ctas)
  for ctas in default 4 8 16 default 16 8 4; do
    echo "# NCCL_MAX_CTAS=$ctas" | tee -a "$log"
    run env $([ $ctas = default ] || echo NCCL_MAX_CTAS=$ctas) timeout 100 torchrun --nproc_per_node 2 \
      benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs tp2-sp-overlap-cg-compile --warmup 3 --steps 6
  done ;;
gradcopy)
  run timeout 120 python benchmarks/grad_accumulate_gpu.py configs/gpt_1.3b.yaml ;;
optimizer)
  run timeout 120 python benchmarks/optimizer_step_gpu.py --sweep
  run timeout 200 python benchmarks/optimizer_step_gpu.py --sizes 125m 1.3b
  run timeout 120 python benchmarks/optimizer_step_gpu.py --sizes 125m --host-profile ;;
halves)
  run timeout 300 torchrun --nproc_per_node 4 benchmarks/train_gpu.py configs/gpt_6.7b.yaml \
    --runs tp2-sp-pp2-m8-zb-compile tp2-sp-pp2-m8-zb-compile-split16.5_15.5 --warmup 2 --steps 4
  run timeout 300 torchrun --nproc_per_node 4 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
    --runs pp4-m16-zb-compile pp4-m16-zb-compile-split6.5_6.5_6.5_4.5 --warmup 2 --steps 4
  run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py configs/gpt_1.3b.yaml --runs compile-m16 \
    --warmup 2 --steps 4 ;;
axes4)
  run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
    --runs stage1-compile stage1-m8-compile --warmup 3 --steps 5
  run timeout 240 torchrun --nproc_per_node 4 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \
    --runs ${RUNS:-tp2-sp-compile pp2-m8-compile pp2-m8-zb-compile pp2-m8-zb2-compile tp2-sp-pp2-m8-compile} --warmup 3 --steps 5
  [ -n "${WHEELS:-}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore-site \
    "$WHEELS"/megatron_core-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/mcore-site
  for layout in "--tp 2 --micro-batches 1" "--pp 2 --micro-batches 8" "--tp 2 --pp 2 --micro-batches 8"; do
    run timeout 200 torchrun --nproc_per_node 4 benchmarks/peers/megatron_core_gpt.py $layout
  done
  MODES="tp2-dp pp2-dp tp2-pp2" NPROC=4 run bash $PEERS/run_peers.sh
  run timeout 300 torchrun --nproc_per_node 4 benchmarks/train_gpu.py configs/gpt_6.7b.yaml \
    --runs tp2-sp-compile tp2-sp-pp2-m8-compile --warmup 2 --steps 4
  run timeout 200 torchrun --nproc_per_node 4 benchmarks/peers/megatron_core_gpt.py --size 6.7b --micro-batch 2 \
    --tp 2 --pp 2 --micro-batches 8 ;;
eight)
  [ -f data/demo/stdlib_text_document.idx ] || run python -m megazero.cli demo-corpus data/demo
  curve() {
    local name=$1 ranks=$2
    shift 2
    CONFIG=configs/gpt_1.3b.yaml NPROC_PER_NODE=$ranks run timeout 240 bash scripts/pretrain_gpt.sh \
      --data.blend '[[1.0, data/demo/stdlib_text_document]]' --train.train_steps 20 --train.global_batch_size 32 \
      --train.micro_batch_size 4 --train.eval_interval 0 --logging.log_interval 5 \
      --checkpoint.save_on_exit false --logging.run_dir runs/eight/$name "$@"
  }
  curve one-gpu 1
  curve tp2-pp2-dp2-zero1 8 --parallel.tp 2 --parallel.pp 2 --parallel.sequence_parallel true --zero.stage 1
  curve tp2-pp2-dp2-zero3 8 --parallel.tp 2 --parallel.pp 2 --parallel.sequence_parallel true --zero.stage 3
  curve tp8 8 --parallel.tp 8 --parallel.sequence_parallel true
  curve dp8-zero3 8 --zero.stage 3
  run python benchmarks/loss_curves.py runs/eight/one-gpu runs/eight/tp2-pp2-dp2-zero1 runs/eight/tp2-pp2-dp2-zero3 \
    runs/eight/tp8 runs/eight/dp8-zero3 --tolerance 0.02 ;;
eight-speed)
  size=${SIZE:-1.3b}
  config=configs/gpt_${size}.yaml
  run timeout 150 torchrun --nproc_per_node 1 benchmarks/train_gpu.py $config \
    --runs stage1-compile stage1-m8-compile --warmup 3 --steps 5
  run timeout 300 torchrun --nproc_per_node 8 benchmarks/train_gpu.py $config --warmup 3 --steps 5 \
    --runs ${RUNS:-tp2-sp-pp2-m8-compile tp2-sp-pp2-m8-stage3-compile tp8-sp-compile tp8-sp-overlap-compile \
      tp8-sp-overlap-cg-compile stage3-compile}
  PEERS=$PEERS NPROC=8 SIZE=$size MODES="ddp fsdp2" run bash $PEERS/run_peers.sh
  [ -n "${WHEELS:-}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore-site \
    "$WHEELS"/megatron_core-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/mcore-site
  run timeout 200 torchrun --nproc_per_node 8 benchmarks/peers/megatron_core_gpt.py --size $size \
    --tp 2 --pp 2 --micro-batches 8 ;;
esac
