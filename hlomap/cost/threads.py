"""Which kernels XLA:CPU splits over the host's threads, and what that buys a device alone.

Host CPU devices share the machine's cores. XLA:CPU runs most kernels of a program on the
device's own thread, but before it emits code it splits large loop kernels (elementwise ops and
loop fusions, broadcasts, slices, transposes, ...) into up to as many parallel tasks as the host
has cores (its parallel task assignment; the compiled HLO marks such a kernel with
`outer_dimension_partitions`). The rule, as XLA states it, per kernel:

- a kernel doing at most one flop per byte it reads or writes is bound by memory: one task per
  256 KiB it moves (a typical L2 cache), at most ceil(sqrt(cores)) tasks (memory bandwidth does
  not grow with every core);
- a heavier one costs flops + 2 x transcendentals + 10 x bytes "cycles": one task per 100 000,
  at most one per core.

With every device busy the split buys nothing (the cores have no time to spare). With fewer
devices computing than there are cores, each device has `spare_threads` cores to itself and a
split kernel runs min(tasks, spare) times faster than on one thread, on top of the device's
`busy_speedup`. On 8 devices of a 2-core machine the one-device plan of haiku-mlp, whose Adam
updates of 1-2 MB weights XLA splits in two, priced at 2.8x its measured time without this.
"""

from __future__ import annotations

import math

import numpy as np

from hlomap.hlo.opcodes import opcode_names

#: Bytes a memory-bound kernel moves per parallel task (XLA:CPU's L2-sized chunk).
MEMORY_BOUND_BYTES_PER_TASK = 256 * 1024
#: A compute-bound kernel's cost per parallel task, in XLA:CPU's cycle units (about 100 us of
#: work on a 2 GHz core).
COMPUTE_COST_PER_TASK = 100_000.0
#: The cycle units XLA:CPU charges per transcendental and per byte moved.
TRANSCENDENTAL_COST = 2.0
BYTE_COST = 10.0

#: Kernels whose result elements XLA:CPU can compute independently, so that it splits them:
#: elementwise ops (and the loop fusions they form) and the data movement it emits as plain loops.
#: Not dynamic-update-slice (it may run in place, touching only the update), reductions (fused
#: with their inputs they are not loop fusions), or dots and convolutions (libraries with threads
#: of their own).
SPLIT_OPCODES = opcode_names(lambda op: op.elementwise is not None) | {
    "broadcast", "concatenate", "dynamic-slice", "gather", "iota", "pad", "reduce-window", "reverse", "slice",
    "transpose",
}


def parallel_tasks(nbytes: np.ndarray, flops: np.ndarray, transcendentals: np.ndarray, cores: int) -> np.ndarray:
    """How many parallel tasks XLA:CPU splits each kernel into on a host of `cores` cores (1:
    not split), from what the kernel moves and computes (its fused producers' work included).
    Only meaningful for kernels of `SPLIT_OPCODES`."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    flops = np.asarray(flops, dtype=np.float64)
    if cores <= 1:
        return np.ones(nbytes.shape, dtype=np.int64)
    memory_bound = flops <= np.maximum(nbytes, 1.0)
    by_bytes = np.minimum(math.ceil(math.sqrt(cores)), nbytes // MEMORY_BOUND_BYTES_PER_TASK)
    cost = flops + TRANSCENDENTAL_COST * np.asarray(transcendentals, dtype=np.float64) + BYTE_COST * nbytes
    by_cost = np.minimum(cores, cost // COMPUTE_COST_PER_TASK)
    return np.maximum(1, np.where(memory_bound, by_bytes, by_cost)).astype(np.int64)


def spare_threads(cores: int, busy: int) -> float:
    """The cores each of `busy` computing devices has to itself on a host of `cores` cores (1
    when the devices are as many as the cores or more, or the host's cores are unknown: 0)."""
    return max(1.0, cores / max(1, busy))


def split_speedup(tasks: np.ndarray, spare: float) -> np.ndarray:
    """How much faster each kernel of `tasks` parallel tasks runs with `spare` cores to itself
    than on one thread."""
    return np.maximum(1.0, np.minimum(np.asarray(tasks, dtype=np.float64), spare))
