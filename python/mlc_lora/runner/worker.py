"""Entrypoint of a tensor-parallel GPU worker process: `python -m mlc_lora.runner.worker ...`.

disco's ProcessSession starts one per shard with the arguments of tvm.exec.disco_worker. Importing
mlc_lora.runner.sharded registers the worker-side functions (`mlc_lora.sharded.*`) and loading the
runtime library registers NCCL's collectives (`runtime.disco.nccl.*`); contract.NCCL_ENV is set
before NCCL starts.
"""

import sys

from mlc_lora.contract import set_nccl_env

set_nccl_env()

from tvm.exec.disco_worker import main  # noqa: E402  pylint: disable=wrong-import-position

from mlc_lora.errors import MLCLoraError  # noqa: E402  pylint: disable=wrong-import-position
from mlc_lora.runner import sharded  # noqa: E402,F401  pylint: disable=wrong-import-position,unused-import
from mlc_lora.runner.disco import load_nccl  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
    try:
        load_nccl()
    except MLCLoraError as e:  # reported again, with the same hint, if NCCL is ever initialised
        print(f"mlc_lora.runner.worker: {e}", file=sys.stderr)
    try:
        main()
    except (OSError, KeyboardInterrupt):
        pass
