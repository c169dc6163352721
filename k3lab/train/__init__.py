"""k3lab.train: end-to-end training of a K3-shaped model on the book's corpus, FSDP2 x expert x context x pipeline parallel, resumable.

Commands (from the repository root; build the shards first with ``python -m k3lab.data build``)::

    python -m k3lab.train --preset k3-tiny --steps 200 --batch-size 8 --seq-len 128
    torchrun --nproc-per-node 2 -m k3lab.train --preset k3-tiny --dp 2 --steps 200 --batch-size 8 --seq-len 128
    torchrun --nproc-per-node 2 -m k3lab.train --preset k3-tiny --ep 2 --ep-mode moonep --ckpt-dir build/ckpt --ckpt-every 50 --keep-checkpoints 2 --log-jsonl build/train.jsonl
    torchrun --nproc-per-node 2 -m k3lab.train --preset k3-tiny --ep 2 --ep-mode moonep --ckpt-dir build/ckpt --ckpt-every 50 --keep-checkpoints 2 --resume --log-jsonl build/train.jsonl
    torchrun --nproc-per-node 4 -m k3lab.train --preset k3-tiny --cp 2 --ep 2 --doc-mask --batch-size 4 --seq-len 256
    torchrun --nproc-per-node 4 -m k3lab.train --preset k3-tiny --pp 2 --dp 2 --microbatches 4 --batch-size 16 --seq-len 128
    torchrun --nproc-per-node 2 -m k3lab.train --preset k3-tiny --pp 2 --pp-schedule interleaved-1f1b --microbatches 4
    python -m k3lab.train --preset k3-tiny --microbatches 4 --batch-size 32 --seq-len 128
    python -m k3lab.train --preset k3-tiny --compile --steps 20
    torchrun --nproc-per-node 8 -m k3lab.train --preset k3-1b --dp 4 --ep 2 --batch-size 64 --seq-len 2048 --log-every 10
    python -m k3lab.train --preset k3-1b --steps 2000 --log-every 10 --ckpt-dir build/run --stop-after-minutes 8 --resume --log-jsonl build/run/metrics.jsonl

One process runs gloo on CPU (float32) or NCCL on GPU (bf16 autocast, one GPU per rank via LOCAL_RANK).
A resume repeats the run's command with ``--resume`` (its saving flags too: without ``--ckpt-every`` the
resumed part would save only at its end). The ``--stop-after-minutes`` command is one run in parts under a
wall-clock limit: run it again (the same command) until its summary's stopped_at reads n/a (``train``'s
``stopped_at`` None); each part stops at a --log-every step with a checkpoint and appends to the same JSONL
(``k3lab.train.metrics.summarize_log`` sums the parts). One run at a time writes a --ckpt-dir or --log-jsonl
(a lock file; a second is refused).

    config.py      TrainConfig and the command line
    parallel.py    the mesh (k3lab.dist.make_mesh) and its groups; FSDP2 and expert parallelism on a K3Model;
                   regional torch.compile (--compile)
    loader.py      TokenLoader: seeded windows of the token split, layout-independent position
    checkpoint.py  atomic DCP checkpoints (model, optimizer, QB biases, step, loader) and the latest one
    metrics.py     JSONL records, progress bar, summary table; the MFU convention
    pipeline.py    pipeline parallelism: this rank's stages (k3lab.model.split_model) and their schedule
    loop.py        train(config): the step on every rank
    workers.py     functions for k3lab.dist.launch (tests, the book)

Context parallel (``--cp``) cuts each data row's packed tokens into cp pieces: KCP for the KDA layers, an
all-gather of the MLA latents. Pipeline parallel (``--pp``) cuts the model's sublayers into balanced stages
that pass Block AttnRes's completed blocks (and a cut block's partial sum) as one tensor, run by
``torch.distributed.pipelining`` over ``--microbatches`` micro-batches; without it ``--microbatches``
accumulates gradients. ``--pp`` does not combine with ``--mtp`` or ``--doc-mask``. ``--doc-mask`` builds MLA's
mask densely ([B*T, B*T], or [T_local, B*T] per cp rank), so it serves short rows only.
"""
from k3lab.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from k3lab.train.config import TrainConfig, build_parser, parse_args
from k3lab.train.loader import TokenLoader
from k3lab.train.loop import lr_at, main, train
from k3lab.train.parallel import Parallel, build_parallel, compile_blocks, parallelize

__all__ = ["TrainConfig", "TokenLoader", "Parallel", "build_parallel", "build_parser", "compile_blocks",
           "latest_checkpoint", "load_checkpoint", "lr_at", "main", "parallelize", "parse_args", "save_checkpoint",
           "train"]
