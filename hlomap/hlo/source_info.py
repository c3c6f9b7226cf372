"""Source locations of instructions: metadata's source_file/line, or JAX's stack frame tables.

JAX (with debug info) prints `stack_frame_id=N` in metadata and appends FileNames /
FileLocations / StackFrames tables to the module text; the parser keeps them verbatim in
`Module.trailer`. `source_tables` parses them once; `source_location` resolves one instruction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from hlomap.hlo.ir import Instruction, Module

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
