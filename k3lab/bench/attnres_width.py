"""Block AttnRes's training-step overhead against model width, on one GPU.

    python -m k3lab.bench.attnres_width          # d = 2048, 4096, 7168 -> data/results/attnres_width_h200.json
    python -m k3lab.bench.attnres_width --smoke  # tiny sizes, CPU allowed; for checking the script

The mixing moves bytes in proportion to d per token, while the sublayers' GEMMs do work in
proportion to d^2, so the overhead should fall roughly as 1/d. This measures it: the same short
``k3lab.lm.LM`` (attention mixers, 4 layers = 8 sublayers, Block AttnRes N = 4, two sublayers a
block) at each width up to K3's d = 7168, standard residual against Block AttnRes's training path,
each Block step timed in alternation with a standard step (``k3lab.bench.attnres.bench_step``), in
bf16 autocast with compiled and eager sublayers. Four layers keep two K3-wide models and their AdamW
state on one 141 GB GPU; the 24-layer d = 2048 figure is ``k3lab.bench.attnres``'s. Writes the JSON
and prints the table last.
"""
from __future__ import annotations

import argparse
import datetime

import torch

import k3lab
from k3lab.bench import check_out, positive_int, run_info
from k3lab.bench.attnres import PRECISIONS, bench_step
from k3lab.files import write_json


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.attnres_width", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/results/attnres_width_h200.json",
                   help="JSON output path ('' = write nothing; --smoke writes nothing)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU allowed); for checking the script")
    p.add_argument("--widths", type=positive_int, nargs="+", default=[2048, 4096, 7168], help="d values")
    p.add_argument("--precisions", nargs="+", choices=["autocast_compiled", "autocast"],
                   default=["autocast_compiled", "autocast"], help="how the steps run (k3lab.bench.attnres.PRECISIONS)")
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps per variant")
    args = p.parse_args(argv)
    check_out(args.out)

    device = k3lab.setup(verbose=True)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for a CPU check of the script")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    widths, precisions = ([64], ["autocast"]) if args.smoke else (args.widths, args.precisions)
    n_layers, n_blocks, batch, seq = (4, 4, 2, 32) if args.smoke else (4, 4, 4, 2048)
    result = dict(hardware=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, model=f"k3lab.lm.LM attention mixers, {n_layers} layers "
                  f"({2 * n_layers} sublayers), B={batch}, T={seq}, AdamW; Block AttnRes N={n_blocks}",
                  precisions={k: PRECISIONS[k] for k in precisions}, rows=[])
    info = run_info(device)
    # The standard-residual step is timed in this run, in alternation with Block AttnRes's.
    result.update(commit=info["commit"], versions=info["versions"], baselines_same_run=True)
    for d in widths:
        for precision in precisions:
            variants = [("standard", None, {}, precision), (f"block_N{n_blocks}", n_blocks, {}, precision)]
            for row in bench_step(device, d, n_layers, batch, seq, variants, 2 if args.smoke else args.steps):
                result["rows"].append(dict(d=d, **row))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not args.smoke and args.out:
        write_json(args.out, result, indent=1)
        print(f"wrote {args.out}")
    print("\n" + table(result))
    return result


def table(result: dict) -> str:
    lines = [f"Block AttnRes step overhead by width on {result['hardware']} ({result['date']})", result["model"],
             f"{'d':>6}  {'precision':<19}{'Block ms':>9}{'standard':>10}{'overhead':>10}"]
    for r in result["rows"]:
        lines.append(f"{r['d']:>6}  {r['precision']:<19}{r['step_ms']:>9.1f}{r['standard_ms']:>10.1f}"
                     f"{100 * r['overhead']:>9.2f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
