"""`torchrun ... -m inference.tp_rank`: a tensor-parallel rank other than 0 on another machine.

Joins the group through torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
receives the engine arguments from rank 0 and executes its steps until rank 0 shuts down.
See inference/executor.py and docs/parallelism_and_quantization.md.
"""
from inference.executor import main

if __name__ == "__main__":
    main()
