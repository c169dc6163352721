"""The FlashKDA kernels compile for the H200 (sm_90), checked on a CPU-only machine: the interpreter that
runs them here accepts code the GPU compiler refuses (e.g. a tensor-valued ``tl.static_range`` bound),
so CI also runs Triton's compiler and ptxas (from the triton wheel) on them, in a process without
TRITON_INTERPRET (``tests/sm90_compile.py``)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

N_KERNELS = 18  # sm90_compile.KERNELS: gate fwd; scores (forward, replay; K = 256 and float32 at 4 warps);
#                UT inverse (bf16, and float32 with the Newton step), W/U; state fwd (inference at V tiles of 64
#                and, with prefetch, 16; training; replay); state bwd, dq/dk, dW/dv, intra bwd, gate bwd, q/k norm bwd


@pytest.mark.timeout(900)
def test_flashkda_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=840)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert len(lines) == N_KERNELS and all("REG:" in line for line in lines), run.stdout
    # Spills at the launch configs: the capped scores kernel's 176 B are chosen (6 programs per SM); a
    # kernel change that spills kilobytes (the earlier backward's 9 KB) shows here before any GPU run.
    stack = {line.split(":")[0]: int(line.split("STACK:")[1].split()[0]) for line in lines}
    assert max(stack.values()) <= 256, stack
