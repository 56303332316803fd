"""Every Triton kernel compiles natively for sm_90 (H100/H200) within its shared-memory budget.

Needs no GPU: Triton's bundled LLVM and ptxas produce the cubin. Runs in a subprocess because
this test session may have loaded Triton in interpreter mode.
"""

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90():
    script = Path(__file__).with_name("compile_sm90.py")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled 32 kernel configurations for sm_90" in result.stdout
