#!/usr/bin/env bash
# Launch megazero pretraining with torchrun: one node (all local GPUs, or CPU_RANKS gloo ranks on a
# machine without GPUs) or many nodes (torchrun rendezvous; under SLURM see slurm_pretrain_gpt.sbatch).
#
# With no CONFIG it is the README's main job: build the demo corpus and its tokenizer (data/demo,
# once), train configs/demo.yaml on 8 CPU ranks, then print a sample from the final checkpoint.
#
# Knobs (environment variables):
#   CONFIG          YAML config (default: configs/demo.yaml, the CPU demo described above); a relative
#                   path is read from the current folder, else from the repository (configs/...)
#   NPROC_PER_NODE  ranks per node (default: number of visible GPUs, else CPU_RANKS)
#   CPU_RANKS       ranks on a machine without GPUs (default: 8, for tp2 x pp2 x dp2)
#   NNODES          nodes taking part (default: 1, or SLURM_NNODES under SLURM)
#   NODE_RANK       this node's index (default: 0, or SLURM_NODEID)
#   MASTER_ADDR     rendezvous host, required on several nodes (default there: the first SLURM node, found
#                   with scontrol); one node needs none
#   MASTER_PORT     rendezvous port (default: 29500)
# Every argument is passed through to `megazero train` as an override, e.g.
#   scripts/pretrain_gpt.sh --train.train_steps 50 --parallel.tp 1
# Relative paths in the config and the overrides are the current folder's (the demo's, the checkout's).
#
# Stopping: SIGTERM, SIGUSR1 (SLURM's warning) and SIGINT (Ctrl-C) sent to this script reach every
# worker, which saves a checkpoint after its current step; rank 0 prints "megazero: preempted at step
# N by SIG, saved to DIR" and the script exits 75 (0: finished; any other status: failed). A second
# Ctrl-C stops at once without saving. See "Preemption and signals" in docs/training.md.
set -euo pipefail
# The run starts in the caller's folder, so relative paths among the overrides (logging.run_dir,
# data.blend, checkpoint.load, ...) and in CONFIG are the caller's; the demo alone runs in the checkout.
repo=$(cd "$(dirname "$0")/.." && pwd)
script=$repo/scripts/$(basename "$0")
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}  # this checkout's packages, from any folder
for arg in "$@"; do  # wherever they stand, once: under torchrun every rank printed them (after the demo build)
  case "$arg" in
    -h|--help)  # the knobs above, then train's own options
      sed -n '2,/^set -euo pipefail$/p' "$script" | sed -e '$d' -e 's/^# \{0,1\}//'
      exec python -m megazero.cli train --help ;;
    --help-config) exec python -m megazero.cli train --help-config ;;
  esac
done

whole() {  # NAME VALUE LOWEST [HIGHEST]: refuse what torchrun would meet with a traceback
  if ! [[ "$2" =~ ^[0-9]+$ ]] || [ "$((10#$2))" -lt "$3" ] || { [ -n "${4:-}" ] && [ "$((10#$2))" -gt "$4" ]; }; then
    echo "pretrain_gpt.sh: error: $1 must be a whole number from $3${4:+ to $4}, got '$2'" >&2
    exit 2
  fi
}

# The knobs are checked first: a bad one would otherwise be found after the demo build.
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then  # else every rank refused it as an override, naming no CONFIG
  echo "pretrain_gpt.sh: error: unexpected argument '$1': arguments are overrides of megazero train" \
       "(--section.field VALUE); give a config file as CONFIG=$1 $0" >&2
  exit 2
fi
if [ -n "${CONFIG:-}" ] && [ ! -f "$CONFIG" ] && [[ "$CONFIG" != /* ]] && [ -f "$repo/$CONFIG" ]; then
  CONFIG=$repo/$CONFIG  # a config shipped in the checkout (configs/gpt_1.3b.yaml), named from elsewhere
fi
if [ -n "${CONFIG:-}" ] && [ ! -f "$CONFIG" ]; then  # else train's own error came amid torchrun's log lines
  echo "pretrain_gpt.sh: error: CONFIG $CONFIG: no such file (a relative path is read from the current folder," \
       "then from the repository); give a YAML config such as configs/gpt_1.3b.yaml" >&2
  exit 2
fi
[ -z "${NPROC_PER_NODE:-}" ] || whole NPROC_PER_NODE "$NPROC_PER_NODE" 1
whole CPU_RANKS "${CPU_RANKS:-8}" 1
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_PORT=${MASTER_PORT:-29500}
whole NNODES "$NNODES" 1
whole NODE_RANK "$NODE_RANK" 0 "$((10#$NNODES - 1))"
whole MASTER_PORT "$MASTER_PORT" 1 65535
# One node needs no address (--standalone): a container without scontrol, inside a SLURM job, died of
# "scontrol: command not found" looking one up for it.
if [ -z "${MASTER_ADDR:-}" ] && [ "$((10#$NNODES))" -gt 1 ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  if ! command -v scontrol >/dev/null; then
    echo "pretrain_gpt.sh: error: NNODES $NNODES needs MASTER_ADDR, the address of the node of NODE_RANK 0, on" \
         "every node, and scontrol is not here to find it from SLURM_JOB_NODELIST (a container?); export MASTER_ADDR" >&2
    exit 2
  fi
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
if [ -z "${MASTER_ADDR:-}" ] && [ "$((10#$NNODES))" -gt 1 ]; then  # else each node waits at a rendezvous of its own
  echo "pretrain_gpt.sh: error: NNODES $NNODES needs MASTER_ADDR, the address of the node of NODE_RANK 0, on" \
       "every node (under SLURM it is found from SLURM_JOB_NODELIST)" >&2
  exit 2
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}

demo=0
if [ -z "${CONFIG:-}" ]; then
  demo=1
  cd "$repo"  # the demo's data and runs are the checkout's (data/demo, runs/demo)
  CONFIG=configs/demo.yaml
  if [ ! -f data/demo/stdlib_text_document.idx ]; then
    echo "== building the demo corpus, its tokenizer and its shard in data/demo"
    python -m megazero.cli demo-corpus data/demo
  fi
fi
# What this launch is, read once, from CONFIG and the arguments as every rank's `megazero train` reads
# them (megazero.commands.train.launch_facts): the visible GPUs, the device the config (with its
# overrides) trains on, whether it trains or only checks (--check), and the checkpoints and tokenizer
# the demo samples with afterwards. A config of train.device cpu, such as the demo's, runs CPU ranks
# even where GPUs are visible. A config that does not load counts as auto here; train names what is wrong.
facts=$(python -c 'import sys
from megazero.commands.train import launch_facts
print("\n".join(launch_facts(sys.argv[1:])))' "$CONFIG" "$@" 2>/dev/null) || facts=$'0\nauto\ntrain'
mapfile -t launch <<<"$facts"
gpus=${launch[0]} device=${launch[1]} action=${launch[2]} checkpoints=${launch[3]:-} tokenizer=${launch[4]:-}
on_cpu=1
if [ "$gpus" -gt 0 ] && [ "$device" != cpu ]; then on_cpu=0; default_ranks=$gpus; else default_ranks=${CPU_RANKS:-8}; fi
NPROC_PER_NODE=${NPROC_PER_NODE:-$default_ranks}
# CPU ranks share the machine's cores; one thread each keeps them from fighting. (Not told apart by
# their count: the demo's 8 CPU ranks on an 8-GPU machine each took every core.)
[ "$on_cpu" = 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ "$NNODES" -eq 1 ]; then
  rendezvous=(--standalone)
else
  if [ "$NODE_RANK" = 0 ] && ! python -c "import socket, sys; socket.socket().bind(('', int(sys.argv[1])))" \
      "$MASTER_PORT" 2>/dev/null; then
    echo "pretrain_gpt.sh: error: MASTER_PORT $MASTER_PORT is already in use on this node (another job?); set" \
         "MASTER_PORT to a free port" >&2
    exit 2
  fi
  # torchrun's static rendezvous: node NODE_RANK runs ranks NODE_RANK x NPROC_PER_NODE onward, and
  # node 0 (MASTER_ADDR) serves the store. The c10d rendezvous ignores --node_rank and numbers the
  # nodes by host name and process id, so rank 0 (its output, its files) could be on any node.
  rendezvous=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
echo "== training $CONFIG on $NNODES node(s) x $NPROC_PER_NODE rank(s)"

# The launcher is torchrun with the stop signals passed to the workers rather than handled by
# torchrun itself (python -m parallel.launch). It runs in a session of its own, so that a Ctrl-C at
# the terminal reaches it once, through here: this script passes on every signal a terminal or a
# scheduler sends (SIGHUP and SIGQUIT torchrun handles as it always does).
# A signal is held until the launcher has put in its handlers (it does once torch is imported, seconds
# after it starts): before that, SIGTERM or SIGUSR1 would kill it without a word, and a SIGINT would be
# lost (a background job starts with SIGINT ignored) and the run would train on.
launcher=""
pending=""  # a stop signal received and not yet passed on
catches() {  # whether the launcher catches signal $1 yet (TERM, USR1, INT; others: once it catches USR1)
  local caught number
  [ -r "/proc/$launcher/status" ] || return 0  # gone, or no /proc: pass it on
  # the forked shell, before it runs python, still holds this script's traps
  tr '\0' ' ' < "/proc/$launcher/cmdline" 2>/dev/null | grep -q 'parallel\.launch' || return 1
  caught=$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$launcher/status" 2>/dev/null) || return 0
  case "$1" in TERM|USR1|INT) number=$(kill -l "$1") ;; *) number=$(kill -l USR1) ;; esac
  [ -z "$caught" ] || (( (16#$caught >> (number - 1)) & 1 ))
}
pass_on() {
  if [ -n "$launcher" ] && [ -n "$pending" ] && catches "$pending"; then
    kill -s "$pending" "$launcher" 2>/dev/null || true
    pending=""
  fi
}
for sig in TERM USR1 INT HUP QUIT; do
  trap "pending=$sig; pass_on" "$sig"
done
setsid python -m parallel.launch "${rendezvous[@]}" --nproc_per_node "$NPROC_PER_NODE" \
  -m megazero.cli train "$CONFIG" "$@" &
launcher=$!
# A trapped signal cuts `wait` short, so wait in slices until the launcher is gone, passing on a held
# signal once it can take it, then collect its status (bash keeps it for `wait`).
while kill -0 "$launcher" 2>/dev/null; do
  pass_on
  sleep 0.2 &
  wait $! || true
done
wait "$launcher" && status=0 || status=$?
[ "$status" = 0 ] || exit "$status"  # 75: preempted, and rank 0 said where it saved

if [ "$demo" = 1 ] && [ "$action" = train ]; then  # the checkpoints and tokenizer read at the launch
  echo "== a sample from the trained model ($checkpoints)"
  python -m megazero.cli generate "$checkpoints" --tokenizer "$tokenizer" --prompt "def " --tokens 48
fi
