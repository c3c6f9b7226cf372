"""Which JAX device is which plan device, and the mesh over them: one rule for every caller.

A plan names devices by position: plan device i is the i-th device of an SPMD plan's mesh (row-
major over its axes) or the id a pipeline stage lists. Plan device i runs on `order[i]` of the
plan's *device order*, which is

- the devices the caller gives, in their order (`parallelize(..., devices=...)`); else
- with a placement section (`hlomap place`), `jax.devices()[placement.devices[i]]`: a placement
  entry is a position in the list of devices (the cluster's, and the present machine's cluster
  lists `jax.devices()` in order), never JAX's `Device.id`, which need not run 0..n-1 (several
  processes, a TPU slice); plan devices the placement does not name take the devices no position
  took, so the order never lists a device twice; else
- `jax.devices()` (every process's devices when several run).

The runner (SPMD plans and each pipeline stage) and the XLA oracles (`verify.compile`,
`verify.numerics`) build their meshes here, so a placed plan is checked on the devices it runs on.
Mesh axes are `AxisType.Auto`: XLA propagates shardings through the step itself, which is what the
oracles observe and what the runner relies on (an `Explicit` axis would make JAX decide them while
tracing).
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from hlomap.plan import Plan

__all__ = ["DeviceError", "device_positions", "devices_at", "ensure_host_devices", "mesh_of", "ordered_devices",
           "plan_mesh"]

#: What a user on a CPU does to get more devices (the count must be set before JAX starts).
MORE_CPU_DEVICES = "set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax"
FORCE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def ensure_host_devices(count: int) -> None:
    """Let the CPU backend show `count` devices, so that a plan for 8 devices runs on a laptop.
    Only possible before JAX is imported (it reads XLA_FLAGS when its backends start), and
    harmless on GPU machines."""
    import os
    import sys

    flags = os.environ.get("XLA_FLAGS", "")
    if FORCE_DEVICES_FLAG not in flags and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"{flags} {FORCE_DEVICES_FLAG}={count}".strip()


class DeviceError(ValueError):
    """The devices present cannot hold a plan's mesh or placement (the message says how many there
    are and what was asked)."""


def ordered_devices(plan: Plan | None = None, devices: Sequence[Any] | None = None) -> list[Any]:
    """The devices plan device ids index (module docstring)."""
    import jax

    if devices is not None:
        given = list(devices)
        twice = sorted(str(d) for d, count in collections.Counter(given).items() if count > 1)
        if twice:
            raise DeviceError(f"devices lists {', '.join(twice)} more than once: each plan device is its own device")
        return given
    everything = list(jax.devices())
    placement = getattr(plan, "placement", None)
    if placement is None:
        return everything
    physical = plan.physical_devices()  # plan device id -> position in jax.devices()
    missing = sorted(p for p in set(physical.values()) if not 0 <= p < len(everything))
    if missing:
        raise DeviceError(f"the plan's placement (chosen for cluster {placement.cluster or '?'}) names devices "
                          f"{missing} that JAX does not see ({len(everything)} devices); place the plan on a "
                          "cluster of this machine's size")
    taken = set(physical.values())
    spare = [d for position, d in enumerate(everything) if position not in taken]
    order = []
    for i in range(max(physical) + 1):
        if i in physical:
            order.append(everything[physical[i]])
        elif spare:
            order.append(spare.pop(0))
        else:  # too few devices for the ids the plan skips: `devices_at` names the shortfall
            break
    return order


def device_positions(devices: Sequence[Any]) -> tuple[int, ...]:
    """Each device's position in `jax.devices()`: the numbers a placement names (module docstring)."""
    import jax

    position = {d: i for i, d in enumerate(jax.devices())}
    return tuple(position[d] for d in devices)


def _more_devices_hint(devices: Sequence[Any] | None, need: int) -> str:
    """How to get `need` devices: pass more (`devices` given, and JAX has them), or have JAX show
    more host devices (on a CPU)."""
    import jax

    if devices is not None and jax.device_count() >= need:
        return f" (the devices given: pass {need} of JAX's {jax.device_count()})"
    return f" (on a CPU, {MORE_CPU_DEVICES.replace('=N', f'={need}')})"


def devices_at(order: Sequence[Any], ids: Sequence[int], what: str) -> list[Any]:
    """Plan device ids -> the devices of `order` they name, or DeviceError saying how many there are."""
    if max(ids, default=-1) >= len(order):
        raise DeviceError(f"{what} uses plan devices up to {max(ids)}, but {len(order)} devices are available; run "
                          f"on a machine with as many devices (on a CPU, {MORE_CPU_DEVICES}), or explore a plan for "
                          "this cluster")
    return [order[i] for i in ids]


def mesh_of(devices: Sequence[Any], axes: Mapping[str, int] | Sequence[tuple[str, int]]) -> Mesh:
    """A mesh of exactly these devices, in this order (row-major over `axes`), all axes `Auto`."""
    from jax.sharding import AxisType, Mesh

    shape = dict(axes)
    need = math.prod(shape.values())
    if need != len(devices):
        raise DeviceError(f"mesh {shape} needs {need} devices, given {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(shape.values())), tuple(shape),
                axis_types=(AxisType.Auto,) * len(shape))


def plan_mesh(plan: Plan, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh of an SPMD plan: its axes over plan devices 0..n-1 of its device order."""
    shape = dict(plan.mesh_shape)
    need = math.prod(shape.values())
    order = ordered_devices(plan, devices)
    if len(order) < need:
        raise DeviceError(f"the plan's mesh {shape} needs {need} devices; {len(order)} are available"
                          f"{_more_devices_hint(devices, need)}")
    return mesh_of(order[:need], shape)
