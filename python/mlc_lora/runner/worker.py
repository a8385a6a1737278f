"""Entrypoint of a tensor-parallel GPU worker process: `python -m mlc_lora.tp_worker ...`.

disco's ProcessSession starts one per shard with the arguments of tvm.exec.disco_worker. Importing
mlc_lora.tp registers the worker-side functions (`mlc_lora.tp.*`) and loading the runtime library
registers NCCL's collectives (`runtime.disco.nccl.*`); NCCL_NVLS_ENABLE=0 is set before NCCL starts.
"""

import sys

from mlc_lora.contract import set_nccl_env

set_nccl_env()

from tvm.exec.disco_worker import main  # noqa: E402  pylint: disable=wrong-import-position

from . import _ffi_api, tp  # noqa: E402,F401  pylint: disable=wrong-import-position,unused-import

if __name__ == "__main__":
    try:
        tp.load_nccl()
    except tp.MLCLoraError as e:  # reported again, with the same hint, if NCCL is ever initialised
        print(f"mlc_lora.tp_worker: {e}", file=sys.stderr)
    try:
        main()
    except (OSError, KeyboardInterrupt):
        pass
