"""One process of the two-process test (`test_multihost.py`): 4 CPU devices, JAX's coordinator
on localhost, gloo CPU collectives. Runs (a) a hybrid data x model plan whose data axis spans the
two processes and (b) the spmd executor with its stage axis across them, and saves what process 0 sees.

    python -m tests.run.multihost_worker PROCESS_ID PORT OUT.npz
"""

from __future__ import annotations

import sys


def main(process_id: int, port: int, out: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    import numpy as np

    from tests.run.multihost_plans import run_both

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    results = run_both()
    if process_id == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
