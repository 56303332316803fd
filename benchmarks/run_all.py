"""`make bench`: every benchmark in one run; the tables are printed and saved to var/bench/results.md.

Sections run one after another in this process (the serving one starts its own stack).
Select with `make bench ARGS="throughput scheduling"`; the options after a section's name are its own
(`make bench ARGS="fairness --rounds 3"`). Kernels print a notice without CUDA.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback

from benchmarks.common import BENCH_DIR, machine_line

SECTIONS = [
    "peers",
    "serving_peers",
    "throughput",
    "profile",
    "gemm",
    "scheduling",
    "serving",
    "grammar",
    "quant_tp",
    "kernels",
    "fairness",
    "gguf",
    "perplexity",
    "spec",
]


def run_section(name: str, argv: list[str]) -> str:
    module = importlib.import_module(f"benchmarks.{name}")
    result = module.main(argv)
    if isinstance(result, dict):  # serving returns its whole report
        return result.get("tables", "")
    return result if isinstance(result, str) else ""


def parse_sections(argv: list[str]) -> dict[str, list[str]]:
    """Section name -> its options: every word after a section's name up to the next section's name."""
    chosen: dict[str, list[str]] = {}
    for word in argv:
        if word in SECTIONS:
            chosen[word] = []
        elif not chosen:
            raise ValueError(f"unknown section {word!r}; choose from {SECTIONS}")
        else:
            chosen[list(chosen)[-1]].append(word)
    return chosen or {name: [] for name in SECTIONS}


def main(argv: list[str]) -> int:
    try:
        chosen = parse_sections(argv)
    except ValueError as exc:
        print(exc)
        return 2
    print(f"Tessera benchmarks on {machine_line()}", flush=True)
    tables, failed = [f"Machine: {machine_line()}\n"], []
    for name, options in chosen.items():
        print(f"\n== {' '.join([name, *options])} ==", flush=True)
        start = time.perf_counter()
        try:
            tables.append(run_section(name, options))
        except Exception:  # one broken section should not hide the others' figures
            traceback.print_exc()
            failed.append(name)
        print(f"({name} took {time.perf_counter() - start:.0f} s)", flush=True)
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    (BENCH_DIR / "results.md").write_text("\n".join(tables))
    print(f"\nsaved {BENCH_DIR / 'results.md'}")
    if failed:
        print(f"FAILED sections: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
