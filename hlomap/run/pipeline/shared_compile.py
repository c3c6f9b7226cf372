"""One compiled executable for the stages whose programs are identical.

The mpmd executor jits every stage's passes on the stage's own mesh. Stages that run the same
layers (a decoder's middle stages) lower to the same program: the same StableHLO text, with the
same input and output types and shardings over a mesh of the same shape; only the devices differ.
XLA compiles for a device assignment, and JAX 0.10.2 has no public way to run one executable on
another device set, but an executable compiled for one assignment can be loaded for another of the
same shape: JAX's own persistent compilation cache does exactly that on GPUs (its key leaves the
device assignment out, and it deserializes with the assignment of the call at hand). Here the first
stage of a kind is compiled; every later stage whose lowered text and mesh shape match loads that
executable, serialized once, for its own devices (milliseconds instead of a compile).

This leans on JAX internals (`jax.experimental.serialize_executable` and the pickling of an
unloaded executable, `jax._src.compiler.get_compile_options`); where they fail, or a backend
cannot serialize executables, the stage is compiled as usual and a debug line says why.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

__all__ = ["ExecutableCache", "SharedProgram"]

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    compiled: Any  # jax.stages.Compiled, on the devices of the mesh it was compiled for
    devices: tuple[Any, ...]  # that mesh's devices, flat
    serialized: tuple[bytes, Any, Any] | None = None  # (executable, in_tree, out_tree), once asked for


@dataclass
class ExecutableCache:
    """Compiled programs by (SHA-256 of the lowered text and pytrees, mesh shape), shared by an
    executor's stages."""

    entries: dict[tuple[str, tuple[tuple[str, int], ...]], _Entry] = field(default_factory=dict)
    compiled: int = 0  # executables compiled
    loaded: int = 0  # executables loaded for another stage's devices instead of compiled

    def executable(self, lowered: Any, mesh: Any) -> Any:
        """The compiled program for `lowered` on `mesh`: compiled, or loaded from an identical
        program compiled for a mesh of the same shape."""
        # the text's digest, not the text: an executor keeps a key per program of every stage. The
        # argument and result pytrees too: two structures with the same leaves lower to one text,
        # and an executable takes only the structure it was compiled for
        text = f"{lowered.as_text()}\n{lowered.in_tree}\n{lowered.out_tree}"
        key = (hashlib.sha256(text.encode()).hexdigest(), tuple(mesh.shape.items()))
        devices = tuple(mesh.devices.flat)
        entry = self.entries.get(key)
        if entry is not None:
            if entry.devices == devices:
                return entry.compiled
            try:
                moved = _load_for(entry, devices)
            except Exception as err:  # JAX internals changed, or the backend cannot serialize: compile instead
                log.debug("compiling %s again: loading it for other devices failed (%s)", lowered, err)
            else:
                self.loaded += 1
                return moved
        compiled = lowered.compile()
        self.compiled += 1
        self.entries.setdefault(key, _Entry(compiled, devices))
        return compiled


def _load_for(entry: _Entry, devices: tuple[Any, ...]) -> Any:
    """`entry`'s executable loaded for `devices` (the same mesh shape, position for position)."""
    from jax._src.compiler import get_compile_options
    from jax.experimental import serialize_executable

    if entry.serialized is None:
        entry.serialized = serialize_executable.serialize(entry.compiled)
    serialized, in_tree, out_tree = entry.serialized
    by_id = {old.id: new for old, new in zip(entry.devices, devices)}
    source_order = tuple(entry.compiled._executable._unloaded_executable.device_list)
    assignment = np.array([[by_id[d.id].id for d in source_order]])
    options = get_compile_options(1, len(source_order), device_assignment=assignment)
    backend = devices[0].client

    class Unpickler(serialize_executable._JaxPjrtUnpickler):
        def persistent_load(self, pid: Any) -> Any:
            if pid[0] == "device":
                return by_id[pid[1]]
            if pid[0] == "exec":
                return self.backend.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                           compile_options=options)
            return super().persistent_load(pid)

    target = [by_id[d.id] for d in source_order]
    unloaded, args_info, no_kwargs = Unpickler(io.BytesIO(serialized), backend, target).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), out_tree, no_kwargs=no_kwargs)


class SharedProgram:
    """A jitted stage program that takes its executables from an `ExecutableCache`.

    Called like the jitted function. It keeps one executable per argument pytree structure (one
    program may be called with several, such as a gradient accumulator over parameters and over
    auxiliary outputs), looked up on the first call with that structure and again whenever the
    arguments' types or shardings change (as `jax.jit` would compile again): a call the executable
    refuses for its arguments (TypeError or ValueError, before it runs) looks the program up for
    the new arguments."""

    def __init__(self, jitted: Callable[..., Any], mesh: Any, cache: ExecutableCache):
        self.jitted = jitted
        self.mesh = mesh
        self.cache = cache
        self.lowerings = 0  # programs lowered: once per structure and argument types in a steady loop
        self._executables: dict[Any, Any] = {}

    def __call__(self, *args: Any) -> Any:
        structure = jax.tree_util.tree_structure(args)
        executable = self._executables.get(structure)
        if executable is not None:
            try:
                return executable(*args)
            except (TypeError, ValueError):
                pass  # other argument types or shardings: lower again below (a real error recurs there)
        self.lowerings += 1
        executable = self.cache.executable(self.jitted.lower(*args), self.mesh)
        self._executables[structure] = executable
        return executable(*args)
