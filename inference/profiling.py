"""Activation memory peak on CUDA: one forward at the largest step the scheduler can build."""

from __future__ import annotations

import torch

from inference.layers.ops import AttentionMetadata


@torch.inference_mode()
def activation_peak_bytes(engine) -> int:
    """Run max_num_batched_tokens tokens as one prefill with no KV pool bound yet."""
    args, device = engine.args, engine.device
    tokens = min(args.max_num_batched_tokens, engine.max_model_len)
    layer = engine.model.layers[0].self_attn
    blocks = -(-tokens // args.block_size)
    scratch = torch.zeros(
        blocks, args.block_size, layer.num_kv_heads, layer.head_dim, dtype=engine.dtype, device=device
    )
    for lyr in engine.model.layers:
        lyr.self_attn.attn.k_cache = lyr.self_attn.attn.v_cache = scratch
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device=device),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        num_decodes=0,
    )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    hidden = engine.model(ids, torch.arange(tokens, device=device), meta)
    engine.model.compute_logits(hidden[-args.max_num_seqs :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, hidden
    torch.cuda.empty_cache()
    return int(peak)
