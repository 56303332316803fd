"""`torchrun ... -m inference.tp_rank`: a tensor-parallel rank other than 0 on another machine.

Joins the group through torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
receives the engine arguments from rank 0 and executes its steps until rank 0 shuts down.
See inference/multiproc_executor.py and docs/parallelism_and_quantization.md.
"""

from __future__ import annotations

import logging
import os

import torch

from inference.distributed import ParallelConfig, destroy_groups, init_groups
from inference.tp_worker import serve


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        raise SystemExit(
            "rank 0 is the engine (python manage.py engine --arg tensor_parallel_size=N); "
            "run this module on the other ranks"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        torch.cuda.set_device(local % torch.cuda.device_count())
    init_groups(backend, "env://", rank, world_size)
    try:
        serve(ParallelConfig(rank, world_size))
    finally:
        destroy_groups()


if __name__ == "__main__":
    main()
