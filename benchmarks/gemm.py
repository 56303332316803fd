"""CPU GEMMs of the bench model: torch's F.linear (MKL for float32) against oneDNN with packed
weights (inference/layers/onednn.py), and what rounding the row count does to oneDNN's cache.

    python -m benchmarks.gemm
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from benchmarks.common import machine_line, print_table
from inference.layers import onednn

# in_features, out_features of the bench model's GEMMs: qkv, o, gate_up, down, LM head.
SHAPES = [(512, 768), (512, 512), (512, 2816), (1408, 512), (512, 8192)]


def seconds_per_call(fn, repeat: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def gflops_table(rows_list: list[int]) -> str:
    rows = []
    for rows_count in rows_list:
        for in_f, out_f in SHAPES:
            x, w = torch.randn(rows_count, in_f), torch.randn(out_f, in_f)
            packed = onednn.pack(w)
            flops = 2 * rows_count * in_f * out_f
            repeat = max(3, int(2e9 // flops))
            dense = seconds_per_call(lambda: F.linear(x, w), repeat)
            fast = seconds_per_call(lambda: onednn.linear(x, packed), repeat)
            rows.append([rows_count, f"{in_f}x{out_f}", flops / dense / 1e9, flops / fast / 1e9, dense / fast])
    return print_table(
        f"float32 GEMM GFLOP/s, {machine_line()}",
        ["rows", "in x out", "F.linear (MKL)", "oneDNN packed", "speed-up"],
        rows,
    )


def shape_cache_table(max_rows: int, passes: int) -> str:
    """The four layer GEMMs over row counts 1..max_rows in random order, several passes."""
    packed = [onednn.pack(torch.randn(out_f, in_f)) for in_f, out_f in SHAPES[:4]]
    counts = list(range(1, max_rows + 1))
    random.Random(0).shuffle(counts)
    inputs = {n: [torch.randn(n, in_f) for in_f, _ in SHAPES[:4]] for n in counts}
    exact = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    rows = []
    for name, fn in (("exact row counts", exact), ("rounded (padded_rows)", onednn.linear)):
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            for n in counts:
                for x, w in zip(inputs[n], packed):
                    fn(x, w)
            times.append(time.perf_counter() - started)
        rows.append([name, len({onednn.padded_rows(n) if fn is onednn.linear else n for n in counts}) * 4, *times])
    return print_table(
        f"oneDNN primitive cache: 4 GEMMs x {max_rows} row counts, seconds per pass",
        ["shapes", "distinct GEMM shapes", *[f"pass {i + 1} s" for i in range(passes)]],
        rows,
    )


@torch.inference_mode()
def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--cache-rows", type=int, default=600)
    args = parser.parse_args(argv)
    if not onednn.enabled():
        print("oneDNN linear ops are not available in this torch build")
        return ""
    return "\n".join(
        [gflops_table([int(r) for r in args.rows.split(",")]), shape_cache_table(args.cache_rows, passes=3)]
    )


if __name__ == "__main__":
    main()
