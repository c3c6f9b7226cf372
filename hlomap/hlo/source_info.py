"""Where an instruction comes from, read from its metadata: the file and line of the source
(metadata's source_file/line, or JAX's stack frame tables) and the layer it belongs to (the
scopes of JAX's name stack in op_name).

JAX (with debug info) prints `stack_frame_id=N` in metadata and appends FileNames /
FileLocations / StackFrames tables to the module text; the parser keeps them verbatim in
`Module.trailer`. `source_tables` parses them once; `source_location` resolves one instruction.
`layer_name` reads the scope path from op_name (`jit(step)/jvp(layers_0)/dot_general` ->
`layers_0/dot_general`), `scope_of` and `nearest_scopes` the layer scope of such paths.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from hlomap.hlo.ir import Instruction, Metadata, Module

__all__ = [
    "SourceTables",
    "layer_name",
    "nearest_scopes",
    "scope_of",
    "source_location",
    "source_tables",
]

_TABLE_LINE = re.compile(r"^\s*(\d+)\s+(.*)$")
_KV = re.compile(r"(\w+)=(-?\d+)")


@dataclass(frozen=True)
class SourceTables:
    files: Mapping[int, str]
    locations: Mapping[int, tuple[int, int]]  # id -> (file id, line)
    frames: Mapping[int, tuple[int, int]]  # id -> (location id, parent frame id)


def source_tables(module: Module) -> SourceTables:
    files: dict[int, str] = {}
    locations: dict[int, tuple[int, int]] = {}
    frames: dict[int, tuple[int, int]] = {}
    section = ""
    for line in module.trailer.splitlines():
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = stripped
            continue
        m = _TABLE_LINE.match(line)
        if not m:
            continue
        key, rest = int(m.group(1)), m.group(2)
        if section == "FileNames":
            files[key] = rest.strip().strip('"')
        elif section == "FileLocations":
            kv = dict((k, int(v)) for k, v in _KV.findall(rest))
            locations[key] = (kv.get("file_name_id", 0), kv.get("line", 0))
        elif section == "StackFrames":
            kv = dict((k, int(v)) for k, v in _KV.findall(rest))
            frames[key] = (kv.get("file_location_id", 0), kv.get("parent_frame_id", 0))
    return SourceTables(files, locations, frames)


def source_location(inst: Instruction, tables: SourceTables | None = None) -> str | None:
    """`file:line` of an instruction from its metadata: source_file/source_line, or JAX's
    stack_frame_id resolved through the module's StackFrames tables (`source_tables(module)`,
    parsed once by the caller). None when unknown."""
    md = inst.metadata
    if md is None:
        return None
    if md.source_file:
        return f"{md.source_file}:{md.source_line}" if md.source_line is not None else md.source_file
    if md.stack_frame_id is None or tables is None:
        return None
    frame = tables.frames.get(md.stack_frame_id)
    if frame is None:
        return None
    file_id, line = tables.locations.get(frame[0], (0, 0))
    path = tables.files.get(file_id)
    return f"{path}:{line}" if path else None


# ---------------------------------------------------------------------------------------------
# Layers: JAX's name stacks in op_name
# ---------------------------------------------------------------------------------------------

#: Name-stack wrappers JAX puts around scopes; `layer_name` unwraps them.
_WRAPPERS = frozenset({"jvp", "transpose", "jit", "pjit", "remat", "checkpoint", "vmap", "pmap"})
_WRAPPED = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")


def _split_top_level(text: str) -> list[str]:
    """Split a name stack on '/' outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif ch == "/" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _unwrap(component: str) -> list[str]:
    """`transpose(jvp(layers_0))` -> ['layers_0']; `jvp()` -> []; `jit(_take)` -> ['_take']."""
    match = _WRAPPED.match(component)
    while match and match.group(1) in _WRAPPERS:
        component = match.group(2)
        match = _WRAPPED.match(component)
    return [part for part in _split_top_level(component) if part]


def layer_name(metadata: Metadata | None, fallback: str = "") -> str:
    """The scope path of an op from its metadata op_name, without JAX's transformation wrappers:
    `jit(train_step)/jvp(layers_0)/dot_general` -> `layers_0/dot_general`."""
    if metadata is None or not metadata.op_name:
        return fallback
    return _layer_path(metadata.op_name) or fallback


@functools.lru_cache(maxsize=1 << 16)
def _layer_path(op_name: str) -> str:
    """`layer_name` of an op_name (kept: a pipeline attribution asks for each op's scope in
    several passes over a step of tens of thousands of ops)."""
    # Fused ops list several names separated by ';': the first is representative.
    components = _split_top_level(op_name.split(";")[0])
    if components and components[0].startswith(("jit(", "pjit(")):
        components = components[1:]  # the step function itself
    return "/".join(part for component in components for part in _unwrap(component))


def scope_of(layer: str) -> str:
    """`layers_0/attn/dot_general` -> `layers_0/attn`; a bare op name has no scope: ''."""
    return layer.rsplit("/", 1)[0] if "/" in layer else ""


def nearest_scopes(layers: Sequence[str]) -> tuple[str, ...]:
    """For each layer name, its own scope, else `after X` with X the scope of the closest scoped
    name before it, else `before X` with the closest after it, else ''; so that every position
    of a chain of ops names a layer (as Auto-MAP's Table 7 names its cuts)."""
    own = [scope_of(name) for name in layers]
    out = list(own)
    previous = ""
    for i, scope in enumerate(own):
        if scope:
            previous = scope
        elif previous:
            out[i] = f"after {previous}"
    following = ""
    for i in range(len(own) - 1, -1, -1):
        if own[i]:
            following = own[i]
        elif not out[i] and following:
            out[i] = f"before {following}"
    return tuple(out)
