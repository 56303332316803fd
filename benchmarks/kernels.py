"""Benchmark the Triton attention kernels against the torch reference path (CUDA only).

Decode: paged decode attention for batch 64..256 at 1k..8k context in bf16; reports time, the
achieved memory bandwidth (K/V bytes that must be read / time) and its fraction of the device's
peak (--peak-gbps, H200 ~4800 GB/s), next to the torch reference. Target: >= 70% of peak at 4k.
Prefill: ragged causal prefill/extend attention; reports TFLOP/s for both paths.

    python benchmarks/kernels.py [--peak-gbps 4800] [--quick] [--json results.json]

Without CUDA it prints a message and exits 0 (the kernels' correctness is covered by
tests/kernels on CPU through Triton's interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def make_paged(batch, context, num_kv_heads, head_dim, block_size, dtype, device, gen):
    """Caches holding `batch` sequences of `context` tokens in shuffled (non-contiguous) blocks."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    ids = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    block_tables = ids.view(batch, blocks_per_seq)
    return k_cache, v_cache, block_tables


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)  # milliseconds


def decode_rows(args, device, gen):
    from tessera_kernels import torch_ref
    from tessera_kernels.decode_attention import paged_decode_attention, pick_num_splits

    hq, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    batches = [64, 256] if args.quick else [64, 128, 256]
    contexts = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    rows = []
    for batch in batches:
        for context in contexts:
            k_cache, v_cache, block_tables = make_paged(batch, context, hkv, d, bs, torch.bfloat16, device, gen)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=device, generator=gen)
            scale = d**-0.5
            args_ = (q, k_cache, v_cache, block_tables, seq_lens, scale)
            out = paged_decode_attention(*args_)
            ref = torch_ref.paged_decode_attention(*args_)
            max_err = (out.float() - ref.float()).abs().max().item()
            # Bytes that must move: all K and V of every sequence, plus q, out and block tables.
            kv_bytes = 2 * batch * context * hkv * d * k_cache.element_size()
            other_bytes = 2 * q.numel() * q.element_size() + block_tables.numel() * 4
            ms = bench(lambda: paged_decode_attention(*args_))
            ms_ref = bench(lambda: torch_ref.paged_decode_attention(*args_))
            gbps = (kv_bytes + other_bytes) / ms / 1e6
            gbps_ref = (kv_bytes + other_bytes) / ms_ref / 1e6
            rows.append(
                dict(
                    kind="decode",
                    batch=batch,
                    context=context,
                    splits=pick_num_splits(batch, hkv, block_tables.shape[1] * bs, device),
                    triton_ms=ms,
                    torch_ms=ms_ref,
                    triton_gbps=gbps,
                    torch_gbps=gbps_ref,
                    triton_peak_frac=gbps / args.peak_gbps,
                    torch_peak_frac=gbps_ref / args.peak_gbps,
                    speedup=ms_ref / ms,
                    max_abs_err=max_err,
                )
            )
            print(
                f"decode  B={batch:4d} ctx={context:5d} splits={rows[-1]['splits']:2d}  "
                f"triton {ms:8.3f} ms {gbps:7.0f} GB/s ({100 * gbps / args.peak_gbps:5.1f}% of peak)  "
                f"torch {ms_ref:8.3f} ms {gbps_ref:7.0f} GB/s ({100 * gbps_ref / args.peak_gbps:5.1f}%)  "
                f"x{ms_ref / ms:5.2f}  max|err| {max_err:.3g}",
                flush=True,
            )
            del k_cache, v_cache, block_tables, q, out, ref
            torch.cuda.empty_cache()
    return rows


def prefill_rows(args, device, gen):
    from tessera_kernels import torch_ref
    from tessera_kernels.prefill_attention import paged_prefill_attention

    hq, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    # (sequences, new tokens each, cached prefix each): fresh prompts and an extend over a prefix.
    shapes = (
        [(4, 2048, 0), (4, 512, 3584)] if args.quick else [(8, 1024, 0), (4, 2048, 0), (1, 8192, 0), (4, 512, 3584)]
    )
    rows = []
    for num_seqs, q_len, prefix in shapes:
        total = q_len + prefix
        k_cache, v_cache, block_tables = make_paged(num_seqs, total, hkv, d, bs, torch.bfloat16, device, gen)
        seq_lens = torch.full((num_seqs,), total, dtype=torch.int32, device=device)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len
        q = torch.randn(num_seqs * q_len, hq, d, dtype=torch.bfloat16, device=device, generator=gen)
        args_ = (q, k_cache, v_cache, block_tables, qsl, seq_lens, d**-0.5)
        out = paged_prefill_attention(*args_)
        ref = torch_ref.paged_prefill_attention(*args_)
        max_err = (out.float() - ref.float()).abs().max().item()
        # Useful FLOPs under the causal mask: query j (0-based) sees prefix + j + 1 keys; two
        # matmuls (QK^T, PV) of 2 * D FLOPs per (query, key, head).
        pairs = num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)
        flops = 4 * pairs * d * hq
        ms = bench(lambda: paged_prefill_attention(*args_))
        ms_ref = bench(lambda: torch_ref.paged_prefill_attention(*args_))
        rows.append(
            dict(
                kind="prefill",
                num_seqs=num_seqs,
                q_len=q_len,
                prefix=prefix,
                triton_ms=ms,
                torch_ms=ms_ref,
                triton_tflops=flops / ms / 1e9,
                torch_tflops=flops / ms_ref / 1e9,
                speedup=ms_ref / ms,
                max_abs_err=max_err,
            )
        )
        print(
            f"prefill seqs={num_seqs} new={q_len:5d} prefix={prefix:5d}  "
            f"triton {ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  torch {ms_ref:8.3f} ms "
            f"{flops / ms_ref / 1e9:6.1f} TFLOP/s  x{ms_ref / ms:5.2f}  max|err| {max_err:.3g}",
            flush=True,
        )
        del k_cache, v_cache, block_tables, q, out, ref
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="device peak HBM bandwidth (H200: ~4800)")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smaller grid (about a minute)")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py: no CUDA device available; nothing to measure "
            "(kernel correctness runs on CPU: pytest tests/kernels)."
        )
        return 0
    device = torch.device("cuda")
    print(
        f"device: {torch.cuda.get_device_name(device)}; peak assumed {args.peak_gbps:.0f} GB/s; "
        f"Hq={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size}, bf16",
        flush=True,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    rows = decode_rows(args, device, gen)
    if not args.skip_prefill:
        rows += prefill_rows(args, device, gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(device), peak_gbps=args.peak_gbps, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
