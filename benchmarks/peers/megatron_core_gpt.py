"""The megatron-core peer: the GPT of ``configs/gpt_1.3b.yaml`` built with megatron-core's own
``GPTModel`` and trained through its ``forward_backward`` schedule, at a given tp / pp / dp.

Same model as megazero's 1.3B run: 24 layers, hidden 2048, 16 heads, sequence 2048, GPT-2's
vocabulary padded to a multiple of 128, learned positions, LayerNorm, GELU, tied head, bf16,
micro-batch 8. Layers come from the *local* layer spec (``get_gpt_layer_local_spec``: megatron-core's
plain-PyTorch modules), because the fast spec needs Transformer Engine, whose torch extension has to
be compiled and cannot be built on the GPU machines; that also means its unfused core attention
(no flash attention), which is the peer a user without Transformer Engine gets. The local spec's
torch LayerNorm refuses sequence parallelism (only apex's or Transformer Engine's norms take it), so
its tensor parallelism runs without it: all-reduces instead of all-gather / reduce-scatter, the same
bytes on two GPUs. Pipelines use megatron-core's 1F1B (``--virtual-stages 2``: its interleaved
schedule). Chunks are cast to bf16 by megatron-core's ``Float16Module``, as its own trainer does.
Gradients reduce through megatron-core's ``DistributedDataParallel`` and the distributed (ZeRO-1)
optimizer, as megazero's stage 1 does. It prints one JSON line like the other peers (tokens/s and
TFLOP/s per GPU, MFU, peak memory).

On the GPU machine (no registry there): carry the wheel, install it without dependencies, run::

    pip download --no-deps -d .peers/wheels megatron-core      # where a registry is reachable
    pip install --no-deps .peers/wheels/megatron_core-*.whl
    torchrun --nproc-per-node 2 benchmarks/peers/megatron_core_gpt.py --tp 2
    torchrun --nproc-per-node 2 benchmarks/peers/megatron_core_gpt.py --pp 2 --micro-batches 8
    torchrun --nproc-per-node 4 benchmarks/peers/megatron_core_gpt.py --tp 2 --pp 2

``--cpu`` (gloo, a tiny model, tp = pp = 1) only builds the model and checks it has the peers' GPT
parameter count: megatron-core's local attention and its schedules allocate CUDA buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from common import GPT, PEAK_TFLOPS, SIZES, VOCAB, Size, flops_per_token, layout_parser


def parse_args() -> argparse.Namespace:
    p = layout_parser(__doc__.splitlines()[0])
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=8, help="per step and data-parallel rank")
    p.add_argument("--cpu", action="store_true", help="gloo and a tiny model: a construction check, no timing")
    return p.parse_args()


def transformer_config(size: Size, args, cpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.float32 if cpu else torch.bfloat16
    return TransformerConfig(
        num_layers=size.layers, hidden_size=size.hidden, num_attention_heads=size.heads,
        ffn_hidden_size=4 * size.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.virtual_stages if args.virtual_stages > 1 else None,
        sequence_parallel=False, bf16=not cpu, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=cpu, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False)


def build_models(config, args, seq: int) -> list:
    """This rank's model chunks (one, or ``virtual_stages`` for the interleaved schedule)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    chunks = []
    for v in range(args.virtual_stages):
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v) if args.virtual_stages > 1 \
            else parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v) if args.virtual_stages > 1 \
            else parallel_state.is_pipeline_last_stage()
        extra = {"vp_stage": v} if args.virtual_stages > 1 else {}
        chunks.append(GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                               max_sequence_length=seq, pre_process=first, post_process=last,
                               share_embeddings_and_output_weights=True,
                               position_embedding_type="learned_absolute", **extra))
    return chunks


def main() -> None:
    args = parse_args()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if args.cpu:
        dist.init_process_group("gloo")
        device, size, seq = torch.device("cpu"), Size(2, 64, 4), 32
        args.tp = args.pp = args.virtual_stages = 1
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        device, size, seq = torch.device("cuda"), SIZES[args.size], args.seq
    # the virtual size picks the interleaved schedule in get_forward_backward_func
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.virtual_stages if args.virtual_stages > 1 else None)
    if not args.cpu:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = transformer_config(size, args, args.cpu)
    chunks = build_models(config, args, seq)
    models = chunks
    if not args.cpu:
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                            use_distributed_optimizer=True)
        from megatron.core.transformer.module import Float16Module
        models = [DistributedDataParallel(config, ddp, Float16Module(config, chunk.cuda())) for chunk in chunks]
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.1,
                                                           adam_beta1=0.9, adam_beta2=0.95, bf16=True,
                                                           use_distributed_optimizer=True), models)
        config.no_sync_func = [m.no_sync for m in models] if len(models) > 1 else models[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads

    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, VOCAB, (args.micro_batch, seq), device=device, generator=g)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)

    def forward_step(data_iterator, model):
        next(data_iterator)
        out = model(tokens, positions, None, labels=tokens)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    def step():
        for m in models:
            m.zero_grad_buffer() if hasattr(m, "zero_grad_buffer") else m.zero_grad(set_to_none=True)
        optimizer.zero_grad()
        data = [iter(range(args.micro_batches)) for _ in models]
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data if len(models) > 1 else data[0],
                                    model=models if len(models) > 1 else models[0],
                                    num_microbatches=args.micro_batches, seq_length=seq,
                                    micro_batch_size=args.micro_batch, forward_only=False)
        optimizer.step()

    if args.cpu:  # its local attention and its schedules allocate CUDA buffers: construction only
        with torch.device("meta"):
            expected = sum(p.numel() for p in GPT(size, seq).parameters())
        built = sum(p.numel() for m in models for p in m.parameters())
        if dist.get_rank() == 0:
            print(json.dumps({"mode": "megatron-core", "cpu_check": "built", "params": built,
                              "same_as_peer_gpt": built == expected}))
        dist.destroy_process_group()
        return
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / args.steps
    # tokens a model replica trains per step, shared by its tp * pp GPUs
    tokens_per_gpu = args.micro_batches * args.micro_batch * seq / (args.tp * args.pp) / step_s
    tflops = tokens_per_gpu * flops_per_token(size, seq) / 1e12
    if dist.get_rank() == 0:
        print(json.dumps({"mode": "megatron-core", "model": args.size, "seq": seq, "tp": args.tp, "pp": args.pp,
                          "dp": parallel_state.get_data_parallel_world_size(), "v": args.virtual_stages,
                          "micro_batch": args.micro_batch, "micro_batches": args.micro_batches,
                          "layer_spec": "local", "tokens_per_s_per_gpu": round(tokens_per_gpu),
                          "tflops_per_gpu": round(tflops, 1), "mfu_989": round(tflops / PEAK_TFLOPS, 3),
                          "step_ms": round(1e3 * step_s, 1),
                          "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
