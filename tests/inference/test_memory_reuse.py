"""A CPU engine keeps freed memory for its next step (engine_setup.keep_freed_memory): without it glibc
returns every freed block over 32 MiB (a long prefill chunk's MLP activations) to the OS, and each step
faults those pages in again."""

import subprocess
import sys
from pathlib import Path

PROBE = """
import resource, sys, torch
from inference import LLM

def faults_of_a_64_mib_tensor_made_again():
    torch.empty(16 << 20).fill_(1.0)  # 64 MiB, freed at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

before_engine = faults_of_a_64_mib_tensor_made_again()
LLM(model=sys.argv[1], device="cpu", max_model_len=64, num_kv_blocks=8)
print(before_engine, faults_of_a_64_mib_tensor_made_again())
"""


def test_a_cpu_engine_keeps_freed_memory_for_the_next_step(tiny_model_dir):
    # a process of its own: the setting is process-wide, and this one has made engines before
    args = [sys.executable, "-c", PROBE, tiny_model_dir]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    before_engine, after_engine = map(int, done.stdout.split()[-2:])
    assert before_engine > 8_000  # most of the 16,384 pages of 4 KiB faulted in again
    assert after_engine < 1_000  # the same memory, still mapped
