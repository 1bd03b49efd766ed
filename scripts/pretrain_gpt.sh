#!/usr/bin/env bash
# Launch megazero pretraining with torchrun: one node (all local GPUs, or CPU_RANKS gloo ranks on a
# machine without GPUs) or many nodes (torchrun rendezvous; under SLURM see slurm_pretrain_gpt.sbatch).
#
# With no CONFIG it is the README's main job: build the demo corpus and its tokenizer (data/demo,
# once), train configs/demo.yaml on 8 CPU ranks, then print a sample from the final checkpoint.
#
# Knobs (environment variables):
#   CONFIG          YAML config (default: configs/demo.yaml, the CPU demo described above)
#   NPROC_PER_NODE  ranks per node (default: number of visible GPUs, else CPU_RANKS)
#   CPU_RANKS       ranks on a machine without GPUs (default: 8, for tp2 x pp2 x dp2)
#   NNODES          nodes taking part (default: 1, or SLURM_NNODES under SLURM)
#   NODE_RANK       this node's index (default: 0, or SLURM_NODEID)
#   MASTER_ADDR     rendezvous host (default: localhost, or the first SLURM node)
#   MASTER_PORT     rendezvous port (default: 29500)
# Every argument is passed through to `megazero train` as an override, e.g.
#   scripts/pretrain_gpt.sh --train.train_steps 50 --parallel.tp 1
set -euo pipefail
cd "$(dirname "$0")/.."

demo=0
if [ -z "${CONFIG:-}" ]; then
  demo=1
  CONFIG=configs/demo.yaml
  if [ ! -f data/demo/stdlib_text_document.idx ]; then
    echo "== building the demo corpus, its tokenizer and its shard in data/demo"
    python -m megazero.cli demo-corpus data/demo
  fi
fi
gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -gt 0 ] && [ "$demo" = 0 ]; then default_ranks=$gpus; else default_ranks=${CPU_RANKS:-8}; fi
NPROC_PER_NODE=${NPROC_PER_NODE:-$default_ranks}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
# CPU ranks share the machine's cores; one thread each keeps them from fighting.
[ "$default_ranks" = "$gpus" ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ "$NNODES" -eq 1 ]; then
  rendezvous=(--standalone)
else
  rendezvous=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_backend c10d
              --rdzv_id "${SLURM_JOB_ID:-megazero}" --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT")
fi
echo "== training $CONFIG on $NNODES node(s) x $NPROC_PER_NODE rank(s)"
torchrun "${rendezvous[@]}" --nproc_per_node "$NPROC_PER_NODE" -m megazero.cli train "$CONFIG" "$@"
if [ "$demo" = 1 ]; then
  echo "== a sample from the trained model (runs/demo/checkpoints)"
  python -m megazero.cli generate runs/demo/checkpoints --tokenizer data/demo/tokenizer.model --prompt "def " --tokens 48
fi
