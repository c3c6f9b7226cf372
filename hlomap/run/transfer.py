"""Moving values between the host and devices, also when a sharding spans several processes.

Both SPMD plans and pipeline executors place the state they are given and gather what they hand
back; with several processes (`jax.distributed`) a value is placed from every process's full copy
and gathered from every process's shards.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["put", "to_host"]


def put(value: Any, sharding: Any, *, own: bool = True) -> Any:
    """`jax.device_put`, also when the sharding spans several processes (every process passes the
    same full value and keeps its own shards). With `own`, into buffers of its own: the steps
    donate the state they are given, which must not delete the caller's arrays (`device_put` may
    hand back the caller's buffer as one of the shards, even with `may_alias=False`); arguments
    no step donates (the batch) skip that copy."""
    if own and isinstance(value, jax.Array) and value.is_fully_addressable:
        value = jax.numpy.copy(value)
    if jax.process_count() == 1 or getattr(sharding, "is_fully_addressable", True):
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(value: Any) -> np.ndarray:
    """A numpy copy of an array, gathered from every process when it spans several."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)
