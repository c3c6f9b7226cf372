"""The one device-id rule (`hlomap.verify.mesh`): plan device i is `order[i]`; a placement entry
is a position in `jax.devices()`, not a `Device.id`; the runner and the XLA oracles share it."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.hlo.capture import capture
from hlomap.plan import Placement, Plan, PlanSource
from hlomap.verify.compile import compile_plan
from hlomap.verify.mesh import DeviceError, device_positions, devices_at, mesh_of, ordered_devices, plan_mesh

#: A non-identity placement of a data 2 x model 4 plan on the 8 simulated devices.
ORDER = (5, 7, 3, 1, 0, 2, 6, 4)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """A device whose id is not its position (only `ordered_devices` and `device_positions` see it)."""

    id: int


def _spmd_plan(placement: Placement | None = None) -> Plan:
    return Plan(mesh=(("data", 2), ("model", 4)), parameters=(), source=PlanSource("test", ""), placement=placement)


def _positions(mesh: jax.sharding.Mesh) -> list[int]:
    everything = jax.devices()
    return [everything.index(d) for d in np.asarray(mesh.devices).flat]


def test_without_a_placement_plan_devices_are_jax_devices_in_order() -> None:
    assert ordered_devices(_spmd_plan()) == list(jax.devices())
    assert ordered_devices(None) == list(jax.devices())


def test_devices_the_caller_gives_win_over_the_placement() -> None:
    given = list(reversed(jax.devices()))
    assert ordered_devices(_spmd_plan(Placement(ORDER)), given) == given


def test_a_placed_plan_lays_its_mesh_on_the_placement_order() -> None:
    placed = _spmd_plan(Placement(ORDER))
    assert ordered_devices(placed) == [jax.devices()[i] for i in ORDER]
    mesh = plan_mesh(placed)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert _positions(mesh) == list(ORDER)


def test_placement_entries_are_positions_not_device_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices whose ids do not run 0..n-1 (several processes, a TPU slice): the placement still
    indexes the list, so a plan placed on a 4-device cluster runs there."""

    fakes = [FakeDevice(100 + 7 * i) for i in range(4)]
    monkeypatch.setattr(jax, "devices", lambda *_: fakes)
    plan = Plan(mesh=(("data", 4),), parameters=(), placement=Placement((2, 0, 3, 1)))
    assert ordered_devices(plan) == [fakes[2], fakes[0], fakes[3], fakes[1]]


def test_a_placement_beyond_the_devices_present_is_refused() -> None:
    plan = Plan(mesh=(("data", 4),), parameters=(), placement=Placement((0, 1, 2, 63), "torus:4x4x4"))
    with pytest.raises(DeviceError, match=r"names devices \[63\] that JAX does not see \(8 devices\)"):
        ordered_devices(plan)


def test_too_few_devices_name_both_counts() -> None:
    with pytest.raises(DeviceError, match="stage 1 uses plan devices up to 9, but 8 devices are available"):
        devices_at(jax.devices(), [8, 9], "stage 1")
    with pytest.raises(DeviceError, match=r"mesh \{'data': 2, 'model': 4\} needs 8 devices, given 4"):
        mesh_of(jax.devices()[:4], {"data": 2, "model": 4})
    with pytest.raises(DeviceError, match=r"needs 16 devices; 8 are available \(on a CPU, set XLA_FLAGS"):
        plan_mesh(Plan(mesh=(("data", 16),), parameters=()))


def test_devices_given_are_checked_and_the_hint_fits_them() -> None:
    """Too few devices passed while JAX has enough: pass more, not the CPU device flag; a device
    given twice is refused before JAX meets it."""
    with pytest.raises(DeviceError, match=re.escape("needs 8 devices; 4 are available (the devices given: pass 8 of "
                                                    "JAX's 8)")):
        plan_mesh(Plan(mesh=(("data", 8),), parameters=()), jax.devices()[:4])
    with pytest.raises(DeviceError, match=re.escape(f"devices lists {jax.devices()[0]} more than once")):
        ordered_devices(None, [jax.devices()[0]] * 8)


def test_the_xla_oracles_compile_a_placed_plan_on_its_placed_devices() -> None:
    """`verify.compile` takes its default mesh from the same rule as the runner."""

    def step(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(x @ w)

    args = (jnp.ones((8, 4)), jnp.ones((2, 8)))
    cap = capture(step, *args)
    plan = Plan.from_specs(cap, (jax.sharding.PartitionSpec(None, "model"), None), mesh={"data": 2, "model": 4})
    placed = dataclasses.replace(plan, placement=Placement(ORDER))
    compiled = compile_plan(step, args, placed)
    assert _positions(compiled.mesh) == list(ORDER)
    np.testing.assert_allclose(float(compiled.compiled(*compiled.place(args))), float(step(*args)))


def test_device_positions_are_what_a_placement_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the runner reports for a stage reads back as the placement that put it there."""

    fakes = [FakeDevice(100 + 7 * i) for i in range(4)]
    monkeypatch.setattr(jax, "devices", lambda *_: fakes)
    placed = Plan(mesh=(("data", 4),), parameters=(), placement=Placement((2, 0, 3, 1)))
    assert device_positions(ordered_devices(placed)) == (2, 0, 3, 1)
