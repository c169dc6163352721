"""Compile every FlashKDA kernel, and the fused short convolution's, for the H200 (sm_90) without a GPU:
Triton's front end, ptxas from the triton wheel. Run as a script WITHOUT TRITON_INTERPRET (the interpreter
accepts code that the compiler refuses, e.g. a tensor-valued tl.static_range bound). Prints one line per
kernel: registers, stack and dynamic shared memory (at the launch options the launcher fixes, else 4 warps
and 3 stages). Arguments, if any, are name prefixes: ``python tests/sm90_compile.py short_conv`` compiles
those kernels only.

The signatures are the bf16 training setup (K = V = 128, bf16 inputs and intermediates), plus the few
variants named in KERNELS.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3lab.kernels.kda import chunk_bwd as cb
from k3lab.kernels.kda import chunk_fwd as cf
from k3lab.kernels.kda import short_conv as sc

BF, F32, I32 = "*bf16", "*fp32", "*i32"
SCALARS = dict(cu_seqlens=I32, chunk_indices=I32, chunk_offsets=I32, scale="fp32", lower_bound="fp32", grid_log2="i32",
               x_scale="fp32")
SHAPE = dict(HV=16, K=128, V=128, BT=64)
SCORES = dict(q=BF, k=BF, beta=BF, G=F32, L=F32, Aqk=BF, W=BF, KG=BF, QG=BF)
SCORES_C = dict(H=16, HV=16, K=128, BT=64, BC=16, BK=128, PREC="tf32", E=None, PACKED=False)
STATE = dict(W=BF, U=BF, KG=BF, G=F32, h=BF, Vn=BF, h0=F32, ht=F32, QG=BF, Aqk=BF, o=BF)
STATE_C = dict(SHAPE, VU=128, BKH=64, BV=64, USE_H0=True, STORE_HT=True, PREFETCH=False, PREC="tf32", BC=16,
               GATE_ENDS=False)
# The short convolution at a channel count C = H*K that is a multiple of 16 (as every K3 config's), which Triton's
# launch specialises, so the row loads vectorise; W = 4 (K3) and the widest, W = 8.
CONV = dict(x=BF, weight=F32, T="i32", C="i32:16")
CONV_BWD = dict(CONV, dy=BF, dpre=F32, dw_part=F32)
CONV_DX = dict(dpre=F32, weight=F32, dx=BF, T="i32", C="i32:16")
CONV_FWD_C = {k: v for k, v in sc.FWD.items() if k != "num_warps"}
CONV_BWD_C = {k: v for k, v in sc.BWD.items() if k != "num_warps"}
CONV_DX_C = {k: v for k, v in sc.DX.items() if k != "num_warps"}


def inverse_precs(exact: bool) -> dict:
    """The UT inverse's precision constexprs as its launcher passes them."""
    return dict(zip(("DIAG_PREC", "BLOCK_PREC"), cf.inverse_precisions(exact)))


KERNELS = {
    "gate_fwd": (cf.kda_gate_fwd_kernel, dict(z=BF, A_log=F32, dt_bias=F32, G=F32),
                 dict(HV=16, K=128, HAS_BIAS=True, BT=64, BC=16, BKG=64, EXACT_SUM=False, E=None, PACKED=False)),
    "gate_fwd_fp32": (cf.kda_gate_fwd_kernel, dict(z=F32, A_log=F32, dt_bias=F32, G=F32),
                      dict(HV=16, K=128, HAS_BIAS=True, BT=64, BC=16, BKG=64, EXACT_SUM=True, E=None, PACKED=False)),
    "gate_fwd_packed": (cf.kda_gate_fwd_kernel, dict(z=BF, A_log=F32, dt_bias=F32, G="*i16", E=F32),
                        dict(HV=16, K=128, HAS_BIAS=True, BT=64, BC=16, BKG=128, EXACT_SUM=False, PACKED=True),
                        dict(num_warps=2)),
    "scores_fwd": (cf.kda_scores_fwd_kernel, SCORES, dict(SCORES_C, REPLAY=False), cf.SCORES_LAUNCH),
    "scores_replay": (cf.kda_scores_fwd_kernel, SCORES, dict(SCORES_C, REPLAY=True), cf.SCORES_LAUNCH),
    "scores_fwd_packed": (cf.kda_scores_fwd_kernel, dict(SCORES, G="*i16", E=F32),
                          {**{k: v for k, v in SCORES_C.items() if k != "E"}, "REPLAY": False, "PACKED": True},
                          cf.SCORES_LAUNCH),
    "scores_fwd_K256": (cf.kda_scores_fwd_kernel, SCORES, dict(SCORES_C, K=256, BK=256, REPLAY=False)),
    "scores_fwd_fp32": (cf.kda_scores_fwd_kernel, dict.fromkeys(SCORES, F32), dict(SCORES_C, PREC="bf16x3",
                                                                                   REPLAY=False)),
    "inverse_fwd": (cf.kda_inverse_fwd_kernel, dict(L=F32, Tinv=BF),
                    dict(HV=16, BT=64, BC=16, **inverse_precs(False))),
    "inverse_fwd_fp32": (cf.kda_inverse_fwd_kernel, dict(L=F32, Tinv=F32),
                         dict(HV=16, BT=64, BC=16, **inverse_precs(True))),
    "wu_fwd": (cf.kda_wu_fwd_kernel, dict(Tinv=BF, v=BF, beta=BF, W=BF, U=BF),
               dict(HV=16, K=128, V=128, BT=64, BV=64, PREC="tf32")),
    "inverse_wu_fwd": (cf.kda_inverse_wu_fwd_kernel, dict(L=F32, v=BF, beta=BF, W=BF, U=BF),
                       dict(HV=16, K=128, V=128, BT=64, BC=16, BV=64, PREC="tf32", **inverse_precs(False))),
    "state_fwd": (cf.kda_state_fwd_kernel, STATE, dict(STATE_C, STORE_STATES=False, OUTPUT=True)),
    "state_fwd_BV16": (cf.kda_state_fwd_kernel, STATE, dict(STATE_C, BV=16, PREFETCH=True, STORE_STATES=False,
                                                            OUTPUT=True)),
    "state_fwd_gate_ends": (cf.kda_state_fwd_kernel, STATE, dict(STATE_C, STORE_STATES=False, OUTPUT=True,
                                                                 GATE_ENDS=True)),
    "state_train": (cf.kda_state_fwd_kernel, STATE, dict(STATE_C, STORE_STATES=True, OUTPUT=True)),
    "state_replay": (cf.kda_state_fwd_kernel, STATE, dict(STATE_C, STORE_STATES=True, OUTPUT=False)),
    "state_bwd": (cb.kda_state_bwd_kernel, dict(QG=BF, KG=BF, W=BF, G=F32, Aqk=BF, do=BF, dh=BF, dVn=BF, dht=F32,
                                                dh0=F32),
                  dict(SHAPE, BKH=64, BV=32, USE_DHT=True, STORE_DH0=True, PREFETCH=True, PREC="tf32")),
    # K = 256: the pipeline stages ``launch_fitting`` reaches on an H200 (3 and 2 do not fit there).
    "state_train_K256": (cf.kda_state_fwd_kernel, STATE, dict(STATE_C, K=256, VU=128, BKH=128, STORE_STATES=True,
                                                               OUTPUT=True), dict(num_stages=1)),
    "state_bwd_K256": (cb.kda_state_bwd_kernel, dict(QG=BF, KG=BF, W=BF, G=F32, Aqk=BF, do=BF, dh=BF, dVn=BF,
                                                     dht=F32, dh0=F32),
                       dict(SHAPE, K=256, BKH=128, BV=32, USE_DHT=True, STORE_DH0=True, PREFETCH=False, PREC="tf32"),
                       dict(num_stages=1)),
    "dqk_bwd": (cb.kda_dqk_bwd_kernel, dict(q=BF, k=BF, G=F32, h=BF, dh=BF, Vn=BF, dVn=BF, do=BF, dqs=F32, dkn=F32,
                                            dG=F32, dW=BF, dgx=F32, rq=F32, rk=F32),
                dict(SHAPE, H=16, BKK=128, BK=64, BV=64, PREC="tf32")),
    "dwv_bwd": (cb.kda_dwv_bwd_kernel, dict(k=BF, v=BF, beta=BF, G=F32, Tinv=BF, dW=BF, dVn=BF, do=BF, Vn=BF,
                                            rk=F32, dkn=F32, dG=F32, db=F32, dv=BF, dAqk=BF, dAkk=BF),
                dict(SHAPE, H=16, BK=32, BV=32, PREC="tf32")),
    "intra_bwd": (cb.kda_intra_bwd_kernel, dict(q=BF, k=BF, beta=BF, G=F32, rq=F32, rk=F32, dAqk=BF, dAkk=BF,
                                                dqs=F32, dkn=F32, dG=F32, dbeta_part=F32, T_total="i32"),
                  dict(H=16, HV=16, K=128, BT=64, BC=16, BKT=64, PREC="tf32")),
    "gate_bwd": (cb.kda_gate_bwd_kernel, dict(z=BF, A_log=F32, dt_bias=F32, dG=F32, dgx=F32, dz=BF, dA_part=F32,
                                              dbias_part=F32),
                 dict(HV=16, K=128, HAS_BIAS=True, BT=64, BKT=32)),
    "qk_norm_bwd": (cb.kda_qk_norm_bwd_kernel, dict(q=BF, k=BF, beta=BF, dqs=F32, dkn=F32, dbeta_part=F32, db=F32,
                                                    dq=BF, dk=BF, dbeta=BF, T_total="i32"),
                    dict(H=16, HV=16, K=128, NKT=4, BR=32, BK=128)),
    "short_conv_fwd": (sc.short_conv_silu_fwd_kernel, dict(CONV, y=BF), dict(CONV_FWD_C, W=4),
                       dict(num_warps=sc.FWD["num_warps"])),
    "short_conv_fwd_W8_fp32": (sc.short_conv_silu_fwd_kernel, dict(CONV, x=F32, y=F32), dict(CONV_FWD_C, W=8),
                               dict(num_warps=sc.FWD["num_warps"])),
    "short_conv_dpre": (sc.short_conv_silu_dpre_kernel, CONV_BWD, dict(CONV_BWD_C, W=4),
                        dict(num_warps=sc.BWD["num_warps"])),
    "short_conv_dpre_W8": (sc.short_conv_silu_dpre_kernel, CONV_BWD, dict(CONV_BWD_C, W=8),
                           dict(num_warps=sc.BWD["num_warps"])),
    "short_conv_dpre_W8_fp32": (sc.short_conv_silu_dpre_kernel, dict(CONV_BWD, x=F32, dy=F32),
                                dict(CONV_BWD_C, W=8), dict(num_warps=sc.BWD["num_warps"])),
    "short_conv_dx": (sc.short_conv_silu_dx_kernel, dict(CONV_DX), dict(CONV_DX_C, W=4), dict(num_warps=sc.DX["num_warps"])),
    "short_conv_dx_W8_fp32": (sc.short_conv_silu_dx_kernel, dict(CONV_DX, dx=F32), dict(CONV_DX_C, W=8),
                              dict(num_warps=sc.DX["num_warps"])),
}


def compile_sm90(fn, pointers: dict, constants: dict, num_warps: int = 4, **options) -> str:
    """Compile one kernel for sm_90 (``options``: more of ``triton.compile``'s, e.g. num_stages, maxnreg);
    returns cuobjdump's resource line (REG, STACK, ...) and SMEM, the dynamic shared memory it launches with."""
    if isinstance(fn, triton.runtime.Autotuner):
        fn = fn.fn
    types = dict(SCALARS, **pointers)
    signature = {name: types.get(name, "constexpr").removesuffix(":16") for name in fn.arg_names}
    # A GPU launch specialises every 16-byte-aligned pointer (all of torch's allocations) as such, which
    # gives vectorised loads; without it the same kernel compiles to many more registers and spills. It does
    # the same for an int argument that is a multiple of 16, typed "i32:16" here.
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature[name][0] == "*" or types.get(name, "").endswith(":16")}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line.strip() for line in usage.splitlines() if "REG:" in line)
    return f"{line} SMEM:{kernel.metadata.shared}"  # dynamic shared memory (Triton's staging buffers), bytes


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1")
    # Arguments: name prefixes of the kernels to compile (default: all).
    prefixes = tuple(sys.argv[1:]) or ("",)
    for name, (fn, pointers, constants, *launch) in KERNELS.items():
        if not name.startswith(prefixes):
            continue
        print(f"{name}: {compile_sm90(fn, pointers, constants, **(launch[0] if launch else {}))}", flush=True)
