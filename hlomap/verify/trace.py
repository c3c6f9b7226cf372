"""Kernel times of XLA:CPU programs, read from JAX's profiler trace.

XLA:CPU records each kernel (thunk) it runs as a trace event named after its HLO instruction
(`dot.52`, `multiply_add_fusion.11`, `ynn_fusion.5` for a dot handed to YNNPACK,
`convolution.54`), beside the runtime's own events (`ThunkExecutor::Execute`, `Wait for usage
holds`, Python frames). `profile_kernels` runs a function under `jax.profiler.trace` and sums the
kernel events per name: the measured side of a per-kernel comparison with the cost model, which
whole step times cannot split (`scripts/report_step_kernels.py`).

An event's duration is wall time while the kernel ran. Where devices share cores (8 host CPU
devices on 2), a kernel's thread can wait for a core mid-kernel, so all-busy durations hold that
wait too; one device alone runs without it.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

__all__ = ["KernelTime", "ProfiledSteps", "is_matrix_kernel", "kernel_times", "profile_kernels", "read_trace_events"]

#: An HLO instruction's name as XLA prints it (letters, digits, `_`, `-`, a `.N` suffix): what
#: kernel events are called. Runtime events have spaces, `::`, `$` or parentheses.
_KERNEL_NAME = re.compile(r"^[A-Za-z_][\w\-]*(\.\d+)*$")
#: Runtime events whose names look like an instruction's.
_RUNTIME_EVENTS = frozenset({"ParseArguments", "AllocateOutputBuffersWithInputReuse"})
#: Kernel names of matrix products: dots, convolutions, and the fusions XLA:CPU hands to a
#: matrix library (YNNPACK's `ynn_fusion`, oneDNN's, Eigen's gemm); whole words, so that a
#: `convert` is not a convolution.
_MATRIX_NAME = re.compile(r"(^|_)(dot|convolution|conv_general|gemm|matmul)([._\-]|$)|ynn|onednn", re.IGNORECASE)


@dataclass(frozen=True)
class KernelTime:
    """One kernel's measured seconds per step (all its calls summed) and calls per step."""

    name: str
    seconds: float
    calls: float

    @property
    def matrix(self) -> bool:
        return is_matrix_kernel(self.name)


@dataclass(frozen=True)
class ProfiledSteps:
    """`steps` calls of a step under the profiler: wall seconds per step (the profiler's own
    cost included) and the kernels per step and device (`devices`: how many ran the step)."""

    steps: int
    devices: int
    wall_seconds: float
    kernels: tuple[KernelTime, ...]

    @property
    def kernel_seconds(self) -> float:
        return sum(k.seconds for k in self.kernels)

    @property
    def matrix_seconds(self) -> float:
        return sum(k.seconds for k in self.kernels if k.matrix)

    @property
    def kernel_calls(self) -> float:
        return sum(k.calls for k in self.kernels)


def is_matrix_kernel(name: str) -> bool:
    """Whether a kernel event's name is a matrix product's (a dot, a convolution, a library
    fusion of them)."""
    return bool(_MATRIX_NAME.search(name))


def read_trace_events(trace_dir: str | Path) -> list[Mapping[str, Any]]:
    """The complete events (`"ph": "X"`) of the newest trace under `trace_dir` (what
    `jax.profiler.trace` writes: `plugins/profile/RUN/HOST.trace.json.gz`)."""
    found = sorted(glob.glob(str(Path(trace_dir) / "**" / "*.trace.json.gz"), recursive=True),
                   key=lambda p: Path(p).stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no *.trace.json.gz written by jax.profiler")
    with gzip.open(found[-1], "rt") as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]


def kernel_times(events: Iterable[Mapping[str, Any]], per: float = 1.0) -> tuple[KernelTime, ...]:
    """The kernel events summed per name, divided by `per` (steps x devices), slowest first."""
    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    for event in events:
        name = str(event.get("name", ""))
        if name in _RUNTIME_EVENTS or not _KERNEL_NAME.match(name):
            continue
        seconds[name] = seconds.get(name, 0.0) + float(event.get("dur", 0.0)) * 1e-6  # us
        calls[name] = calls.get(name, 0) + 1
    rows = (KernelTime(name, seconds[name] / per, calls[name] / per) for name in seconds)
    return tuple(sorted(rows, key=lambda k: (-k.seconds, k.name)))


def profile_kernels(step: Callable[[], Any], *, steps: int = 5, devices: int = 1, warmup: int = 2) -> ProfiledSteps:
    """Run `step` (it blocks until its results are ready) `warmup` times, then `steps` times
    under `jax.profiler.trace`, and read its kernels per step and device (`devices`: how many
    devices each call runs the program on)."""
    import jax

    for _ in range(warmup):
        step()
    with tempfile.TemporaryDirectory() as where:
        jax.profiler.start_trace(where)
        start = time.perf_counter()
        try:
            for _ in range(steps):
                step()
            wall = (time.perf_counter() - start) / steps
        finally:
            jax.profiler.stop_trace()
        events = read_trace_events(where)
    return ProfiledSteps(steps, devices, wall, kernel_times(events, per=steps * devices))
