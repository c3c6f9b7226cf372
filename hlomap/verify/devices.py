"""Microbenchmarks of the present devices: the measurements behind `hlomap calibrate`.

The devices themselves are the oracle here: matmuls per dtype over a sweep of sizes and a
memory-bound elementwise op, on every device at once (each on its own block: the rate a device
achieves while the others work, as in a step); each collective (`jax.shard_map` with `lax.psum`,
`all_gather`, `psum_scatter`, `all_to_all`, `ppermute`) over message sizes on groups of 2, 4, 8
... of the devices; a `jax.device_put` from one device to another (a stage-to-stage send); a
trivial jitted call (the fixed cost of one dispatch). Every sample is the lower quartile of
repeated timed calls after a warm-up call (compilation, first-touch allocation), except the
compute samples: they are timed in several interleaved passes, each the median of its calls, and
keep the median of their passes (`interleaved_passes`). The fits live in
`hlomap.cost.calibration`, which this module only feeds.

It sits in `verify` because it runs programs on the devices (as compiling and running plans
do) and needs nothing above the cost model.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

import numpy as np

from hlomap.cost.calibration import (
    ALONE_SUFFIX,
    COMBINED,
    DISPATCH,
    LAUNCH,
    TRANSFER,
    CalibrationError,
    ClusterCalibration,
    CommSample,
    ExecutorSample,
    HandBackSample,
    Measurement,
)
from hlomap.cost.collectives import Collective
from hlomap.cost.devices import OVERSIZED_CONVOLUTION
from hlomap.verify.timing import load_average

log = logging.getLogger(__name__)

__all__ = ["ACCELERATOR_PLAN", "BenchPlan", "BenchProgress", "DEFAULT_PLAN", "Probe", "QUICK_PLAN", "Timer",
           "collective_group_sizes", "default_plan", "host_bytes_needed", "interleaved_passes", "measure_devices"]


@dataclass(frozen=True)
class BenchPlan:
    """What to time: matmul sides (n x n by n x n), elementwise and message sizes in f32
    elements per device, and how many timed calls a sample is the median of."""

    matmul_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    memory_sizes: tuple[int, ...]
    message_sizes: tuple[int, ...]
    repeats: int
    dispatch_repeats: int
    launch_layers: tuple[int, ...] = (2, 16, 64)  # kernel-launch samples: train steps of this many tiny layers
    combined_buffers: tuple[int, ...] = (1, 8, 32)  # one all-reduce of this many small buffers
    # narrow matrix samples (`hlomap.cost.calibration.fit_narrow_curves`): f32 dots of the largest
    # matmul side by this many columns, and 3x3 convolutions of this many channels in and out over
    # `conv_images` images of `conv_side` x `conv_side` pixels per device; the same over images of
    # `OVERSIZED_SIDE` pixels (the window reaches past them: `OVERSIZED_CONVOLUTION`)
    narrow_dot_widths: tuple[int, ...] = (8, 32, 128)
    narrow_conv_widths: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
    conv_images: int = 8
    conv_side: int = 16
    oversized_conv_widths: tuple[int, ...] = (32, 64)
    # the compute samples (matmuls, narrow products, memory-bound, kernel-launch steps) are timed
    # in this many interleaved passes, each the median of its calls, and keep the median of their
    # passes (`interleaved_passes`, `_median_seconds`)
    kernel_passes: int = 3


#: The largest memory-bound op timed alone too (f32 elements, 4 MiB): one device alone over 16 MiB
#: took 1.1 ms in one calibration and 5.4 ms in the next (8 CPU devices of 2 cores), where the
#: sizes from 64 KiB to 4 MiB agreed within 25%, and a curve pulled down at its end prices every
#: kernel below it (`hlomap.cost.calibration.alone_curves`); the largest alone sample prices
#: larger kernels.
ALONE_MEMORY_ELEMENTS = 2**20
#: The default run: sizes that keep a run on 8 host CPU devices of a small machine well under a
#: minute while spanning latency- and bandwidth-bound messages and the rise of the matmul curve.
DEFAULT_PLAN = BenchPlan(matmul_sizes=(64, 128, 256, 512), dtypes=("f32", "bf16"),
                         memory_sizes=tuple(2**k for k in range(12, 23, 2)),
                         message_sizes=tuple(2**k for k in range(6, 23, 2)), repeats=10, dispatch_repeats=200)
#: An accelerator's run: its matmuls reach their peak only at sides of thousands and its memory
#: bandwidth only on buffers far larger than its caches, so the CPU sizes above would fit a
#: launch-bound curve (an H200 gave 2.6 of its ~790 bf16 TFLOP/s at 512 x 512, 0.5 of 4.3 TB/s on
#: 16 MiB). Up to 8192 x 8192 and 512 MiB per device: ~1.4 ms per bf16 matmul on a Hopper GPU.
ACCELERATOR_PLAN = BenchPlan(matmul_sizes=(128, 256, 512, 1024, 2048, 4096, 8192), dtypes=("f32", "bf16"),
                             memory_sizes=tuple(2**k for k in range(14, 28, 2)) + (2**27,),
                             message_sizes=tuple(2**k for k in range(8, 27, 2)), repeats=10, dispatch_repeats=200,
                             narrow_dot_widths=(8, 32, 128, 512), narrow_conv_widths=(8, 16, 32, 64, 128, 256),
                             conv_images=32, conv_side=64, oversized_conv_widths=(64, 256))
#: `--quick`: enough samples for every fit (two sizes each), in about 12 s on 8 host CPU devices:
#: rough figures. The larger size of each is where its slope shows (smaller ones fit the latency
#: alone: messages of up to 16 KiB priced collectives' bandwidth ~10x low, matmuls of up to 128
#: the f32 peak ~2x low, a median of 2 calls kept bursts). On 8 CPU devices the zoo's dp and
#: megatron plans priced 0.98-1.49x and 1.02-1.31x of a default run made just before, against
#: 1.12-5.66x and 0.94-2.48x with those sizes (`scripts/bench_calibrate.py --quick-against-default`).
QUICK_PLAN = BenchPlan(matmul_sizes=(64, 256), dtypes=("f32", "bf16"), memory_sizes=(2**12, 2**20),
                       message_sizes=(2**8, 2**20), repeats=5, dispatch_repeats=10, launch_layers=(2, 16),
                       combined_buffers=(1, 8), narrow_dot_widths=(8,), narrow_conv_widths=(4, 32),
                       oversized_conv_widths=(32,), kernel_passes=1)

_ITEMSIZE = {"f32": 4, "bf16": 2}
#: The width of the kernel-launch samples' layers: small enough that their compute is nothing.
LAUNCH_SIDE = 8
#: The image side of the oversized-window convolution samples: smaller than their 3x3 window.
OVERSIZED_SIDE = 2
#: f32 elements per device of each buffer of the combined all-reduce samples.
COMBINED_ELEMENTS = 1024


@dataclass(frozen=True)
class BenchProgress:
    """`done` of `total` samples measured; `label` names the last."""

    done: int
    total: int
    label: str

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


def _filled(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    """Ones of `shape` made where `sharding` puts them (not on the first device and then moved:
    an accelerator run's buffers are hundreds of MiB per device)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=sharding)()


def collective_group_sizes(n_devices: int) -> tuple[int, ...]:
    """2, 4, 8 ... up to the device count, and the count itself when it is not a power of two."""
    sizes = [2**k for k in range(1, int(math.log2(n_devices)) + 1)] if n_devices >= 2 else []
    if n_devices >= 2 and sizes[-1] != n_devices:
        sizes.append(n_devices)
    return tuple(sizes)


#: A sample's timer: (a call that blocks until its result is ready, repeats) -> seconds.
Timer = Callable[[Callable[[], Any], int], float]


def _sample_seconds(fn: Callable[[], Any], repeats: int, quantile: float = 0.25) -> float:
    """The lower quartile (or `quantile`) of the wall times of `repeats` calls of `fn` (which
    blocks until its result is ready), after one untimed warm-up call; never below a nanosecond,
    so that the sample is a valid time. A quartile, not the median: on a shared machine other work
    only ever adds time, and a calibration is cached and prices every later plan, so a burst of
    load during it should move it as little as possible (two calibrations on 8 host devices of a
    2-core machine disagreed by 22% on the combined all-reduce's cost per buffer with the median).
    The compute samples keep the median instead (`_median_seconds`)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max(float(np.quantile(times, quantile)), 1e-9)


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median of the timed calls (`_sample_seconds`): what each pass of a compute sample keeps.
    Its passes already outvote a burst (`interleaved_passes`), and the steps it prices run under
    the same contention as it, a step's time being its median, not its best quarter. On 8 host
    devices of 2 cores, one fidelity run each (`scripts/bench_fidelity.py --rounds 10`): with
    lower quartiles in every pass, Spearman 0.942 / 0.984 / 0.954 / 0.948 / 0.910 on gpt-tiny,
    haiku-mlp, bert-tiny, t5-tiny, resnet50-tiny and pipelines within 25% 11 of 20 (0.61-1.15x:
    priced low); with medians, and the launch and executor steps in passes too, 0.979 / 0.976 /
    0.873 / 0.985 / 0.932 and 16 of 20 (0.71-1.35x); docs/benchmarks.md has the rest."""
    return _sample_seconds(fn, repeats, 0.5)


def _ready(x: Any) -> Any:
    import jax

    return jax.block_until_ready(x)


def _collective_program(kind: Collective, group: int) -> Callable[[Any], Any]:
    """The per-device body of one collective over the mesh axis "x" of `group` devices."""
    from jax import lax

    if kind is Collective.ALL_REDUCE:
        return lambda x: lax.psum(x, "x")
    if kind is Collective.ALL_GATHER:
        return lambda x: lax.all_gather(x, "x", tiled=True)
    if kind is Collective.REDUCE_SCATTER:
        return lambda x: lax.psum_scatter(x, "x", tiled=True)
    if kind is Collective.ALL_TO_ALL:
        return lambda x: lax.all_to_all(x, "x", 0, 0, tiled=True)
    perm = [(i, (i + 1) % group) for i in range(group)]
    return lambda x: lax.ppermute(x, "x", perm)


def _message_bytes(kind: Collective, group: int, elements: int) -> float:
    """The byte count the cost model prices a collective by (`hlomap.cost.collectives`): the
    full buffer of an all-gather (its output) or reduce-scatter (its input), else the buffer
    each device holds."""
    local = 4.0 * elements
    return local * group if kind is Collective.ALL_GATHER else local


def _tiny_train_step(ws: list[Any], x: Any) -> list[Any]:
    """One SGD step of a chain of tiny tanh layers, batched over the devices' blocks (no
    communication: the loss's sum over blocks is never computed, only its gradient)."""
    import jax
    import jax.numpy as jnp

    def loss(params: list[Any]) -> Any:
        h = x
        for w in params:
            h = jnp.tanh(jnp.einsum("bij,bjk->bik", h, w))
        return jnp.sum(h * h)

    grads = jax.grad(loss)(ws)
    return [w - 0.01 * g for w, g in zip(ws, grads)]


def _kernels_of(step: Callable[..., Any], *args: Any) -> int:
    """hlomap's kernel count of `step(*args)` (`hlomap.cost.estimate.launched_kernels`)."""
    from hlomap.cost.estimate import launched_kernels
    from hlomap.hlo.capture import capture

    return launched_kernels(capture(step, *args))


Sample = TypeVar("Sample")


@dataclass(frozen=True)
class Probe(Generic[Sample]):
    """One sample, compiled and given its buffers once and timed in every pass: `run` calls its
    program and blocks until it is done; `sample` makes the sample of `seconds`."""

    run: Callable[[], Any]
    sample: Callable[[float], Sample]


Task = tuple[str, Callable[[], Any]]


def interleaved_passes(probes: Sequence[tuple[str, Callable[[], Probe[Sample] | None]]], passes: int, repeats: int,
                       timer: Timer) -> list[Task]:
    """The tasks that time every probe in `passes` passes, one probe after another in each: a
    probe's sample is the median of its passes' `timer` figures, returned by its task in the last
    pass (the earlier ones return None). A probe is prepared in its first pass and dropped after
    its last; one whose preparation returns None is left out (all its tasks return None). Why:
    eight host devices on two cores timed the same all-busy kernel up to 60% apart from one moment
    to the next (a 3x3 convolution of 8 channels 0.75-1.54 ms, ten calls each time), and one
    sample's burst moved every plan priced on it (two calibrations back to back priced
    resnet50-tiny's one-device step 7.8 and 9.9 ms); passes spread over the section let a sample's
    burst be outvoted."""
    prepared: dict[int, Probe[Sample] | None] = {}
    seconds: dict[int, list[float]] = {i: [] for i in range(len(probes))}

    def timed(index: int, last: bool) -> Callable[[], Sample | None]:
        def task() -> Sample | None:
            if index not in prepared:
                prepared[index] = probes[index][1]()
            probe = prepared[index]
            if probe is None:
                return None
            seconds[index].append(timer(probe.run, repeats))
            if not last:
                return None
            del prepared[index]
            return probe.sample(float(np.median(seconds[index])))

        return task

    passes = max(1, passes)
    return [(label if passes == 1 else f"{label} (pass {p + 1} of {passes})", timed(i, p == passes - 1))
            for p in range(passes) for i, (label, _) in enumerate(probes)]


def _tasks(plan: BenchPlan, devices: Sequence[Any]) -> list[Task]:
    """(label, measure) of every sample, in the order they run."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    first = devices[0]
    tasks: list[Task] = []

    # Kernels run on every device at once, each on its own block (no communication): the rate a
    # device achieves while the others work too, as in a step. Devices that share hardware (host
    # CPU devices share the cores and the memory bus) are slower together than alone.
    everywhere = Mesh(np.asarray(devices), ("x",))
    blocks = NamedSharding(everywhere, PartitionSpec("x"))
    count = len(devices)

    def matmul(dtype: str, n: int) -> Probe[Measurement]:
        jdtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
        a = _filled((count, n, n), jdtype, blocks)
        f = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x))
        return Probe(lambda: _ready(f(a)), lambda seconds: Measurement(
            f"dot_{dtype}_{n}", "dot", dtype, 2.0 * n**3, 3.0 * n * n * _ITEMSIZE[dtype], seconds))

    def matmul_alone(n: int) -> Probe[Measurement]:
        # the same f32 matmul on one device while the others idle: how much faster a device is
        # alone than with all busy, by size (`hlomap.cost.calibration.alone_curves`); not part of
        # the curve
        a = jax.device_put(jnp.ones((n, n), jnp.float32), first)
        f = jax.jit(jnp.dot)
        return Probe(lambda: _ready(f(a, a)), lambda seconds: Measurement(
            f"dot_f32_{n}{ALONE_SUFFIX}", "dot", "f32", 2.0 * n**3, 3.0 * n * n * 4, seconds, fit=False))

    def narrow_dot(width: int) -> Probe[Measurement]:
        n = max(plan.matmul_sizes)
        a = _filled((count, n, n), jnp.float32, blocks)
        b = _filled((count, n, width), jnp.float32, blocks)
        f = jax.jit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y))
        return Probe(lambda: _ready(f(a, b)), lambda seconds: Measurement(
            f"dot_f32_{n}x{n}x{width}", "dot", "f32", 2.0 * n * n * width, 4.0 * (n * n + 2 * n * width), seconds,
            width=width))

    def narrow_conv(channels: int, side: int, kind: str) -> Probe[Measurement]:
        images = plan.conv_images
        x = _filled((count * images, side, side, channels), jnp.float32, blocks)
        w = jax.device_put(jnp.full((3, 3, channels, channels), 0.1, jnp.float32), NamedSharding(everywhere, PartitionSpec()))
        f = jax.jit(lambda v, k: lax.conv_general_dilated(v, k, (1, 1), "SAME",
                                                          dimension_numbers=("NHWC", "HWIO", "NHWC")))
        valid = (3 * side - 2) ** 2  # (output, kernel) pairs on real input per image, SAME padding
        suffix = "" if kind == "convolution" else f"_{side}x{side}"
        return Probe(lambda: _ready(f(x, w)), lambda seconds: Measurement(
            f"convolution_f32_3x3_{channels}ch{suffix}", kind, "f32", 2.0 * images * valid * channels * channels,
            4.0 * (2 * images * side * side * channels + 9 * channels * channels), seconds, width=channels))

    def memory(elements: int) -> Probe[Measurement]:
        x = _filled((count * elements,), jnp.float32, blocks)
        f = jax.jit(lambda v: v * 2.0 + 1.0)
        return Probe(lambda: _ready(f(x)), lambda seconds: Measurement(
            f"elementwise_f32_{elements}", "elementwise", "f32", 2.0 * elements, 8.0 * elements, seconds))

    def memory_alone(elements: int) -> Probe[Measurement]:
        # the same op on one device while the others idle (`alone_curves`): alone a device has
        # the caches to itself, and the gain grows with the size
        x = jax.device_put(jnp.ones((elements,), jnp.float32), first)
        f = jax.jit(lambda v: v * 2.0 + 1.0)
        return Probe(lambda: _ready(f(x)), lambda seconds: Measurement(
            f"elementwise_f32_{elements}{ALONE_SUFFIX}", "elementwise", "f32", 2.0 * elements, 8.0 * elements,
            seconds, fit=False))

    def on_group(group: int) -> tuple[Any, Any]:
        """(the first `group` devices as mesh axis "x", a buffer's sharding over it: a block each)."""
        mesh = Mesh(np.asarray(devices[:group]), ("x",))
        return mesh, NamedSharding(mesh, PartitionSpec("x"))

    def collective(kind: Collective, group: int, elements: int) -> CommSample:
        mesh, split = on_group(group)
        body = _collective_program(kind, group)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=split.spec, out_specs=split.spec))
        x = jax.device_put(jnp.ones((group * elements,), jnp.float32), split)
        seconds = _sample_seconds(lambda: _ready(f(x)), plan.repeats)
        return CommSample(kind.value, group, _message_bytes(kind, group, elements), seconds)

    def transfer(elements: int) -> CommSample:
        x = jax.device_put(jnp.ones((elements,), jnp.float32), first)
        seconds = _sample_seconds(lambda: _ready(jax.device_put(x, devices[1])), plan.repeats)
        return CommSample(TRANSFER, 2, 4.0 * elements, seconds)

    def launch(layers: int) -> Probe[CommSample]:
        # A train step of tiny layers (forward, gradient, update), every device on its own block:
        # the kernels a real step launches (dots, elementwise, reductions, their backward), which a
        # chain of one op does not show (an H200 launched tiny matmuls at 1.2 us each, while
        # launch-bound zoo steps cost 4-6 us per kernel). Its `nbytes` is hlomap's own kernel count
        # of the program (`launched_kernels`), so the fitted cost per kernel is priced back on the
        # same count.
        ws = [jax.device_put(jnp.full((count, LAUNCH_SIDE, LAUNCH_SIDE), 0.1, jnp.float32), blocks)
              for _ in range(layers)]
        x = jax.device_put(jnp.ones((count, LAUNCH_SIDE, LAUNCH_SIDE), jnp.float32), blocks)
        f = jax.jit(_tiny_train_step)
        kernels = float(_kernels_of(_tiny_train_step, ws, x))
        return Probe(lambda: _ready(f(ws, x)), lambda seconds: CommSample(LAUNCH, count, kernels, seconds))

    def combined(group: int, buffers: int) -> CommSample:
        # one all-reduce of `buffers` small buffers over `group` devices, as XLA combines a
        # step's gradient all-reduces over a data axis of that size (one group timed, as every
        # collective here: timing every group of the axis at once priced bert-tiny's data x
        # model meshes worse against what they measured, Spearman 0.70 against 0.93)
        mesh, split = on_group(group)
        body = jax.shard_map(lambda *xs: tuple(lax.psum(x, "x") for x in xs), mesh=mesh, in_specs=split.spec,
                             out_specs=split.spec)
        f = jax.jit(body)
        xs = [jax.device_put(jnp.ones((group * COMBINED_ELEMENTS,), jnp.float32), split) for _ in range(buffers)]
        return CommSample(COMBINED, group, float(buffers), _sample_seconds(lambda: _ready(f(*xs)), plan.repeats))

    def dispatch() -> CommSample:
        x = jax.device_put(jnp.zeros((), jnp.float32), first)
        f = jax.jit(lambda v: v + 1.0)
        return CommSample(DISPATCH, 1, 0.0, _sample_seconds(lambda: _ready(f(x)), plan.dispatch_repeats))

    probes: list[tuple[str, Callable[[], Probe[Measurement]]]] = []
    for dtype in plan.dtypes:
        for n in plan.matmul_sizes:
            probes.append((f"matmul {dtype} {n}x{n}", lambda d=dtype, n=n: matmul(d, n)))
    if "f32" in plan.dtypes and count > 1:
        probes.extend((f"matmul f32 {n}x{n} alone", lambda n=n: matmul_alone(n)) for n in plan.matmul_sizes)
    for width in plan.narrow_dot_widths:
        probes.append((f"matmul f32 {max(plan.matmul_sizes)} by {width}", lambda w=width: narrow_dot(w)))
    for channels in plan.narrow_conv_widths:
        probes.append((f"convolution 3x3 of {channels} channels",
                       lambda c=channels: narrow_conv(c, plan.conv_side, "convolution")))
    for channels in plan.oversized_conv_widths:
        probes.append((f"convolution 3x3 of {channels} channels on {OVERSIZED_SIDE}x{OVERSIZED_SIDE} images",
                       lambda c=channels: narrow_conv(c, OVERSIZED_SIDE, OVERSIZED_CONVOLUTION)))
    for elements in plan.memory_sizes:
        probes.append((f"memory {elements * 4} B", lambda e=elements: memory(e)))
        if count > 1 and elements <= ALONE_MEMORY_ELEMENTS:
            probes.append((f"memory {elements * 4} B alone", lambda e=elements: memory_alone(e)))
    # the kernel-launch steps price every step's kernels: compute samples too (their fitted cost
    # per kernel ran 2.6-9.2 us in seven calibrations of one afternoon, timed in one pass each)
    launches: list[tuple[str, Callable[[], Probe[CommSample]]]] = [
        (f"step of {layers} tiny layers", lambda k=layers: launch(k)) for layers in plan.launch_layers]
    tasks.extend(interleaved_passes([*probes, *launches], plan.kernel_passes, plan.repeats, _median_seconds))
    tasks.append(("dispatch", dispatch))
    for group in collective_group_sizes(count):
        for buffers in plan.combined_buffers:
            tasks.append((f"all-reduce of {buffers} buffers x{group}", lambda g=group, b=buffers: combined(g, b)))
    for group in collective_group_sizes(len(devices)):
        for kind in Collective:
            for elements in plan.message_sizes:
                size = max(elements, group) // group * group  # all-to-all and reduce-scatter split it
                tasks.append((f"{kind.value} x{group} {size * 4} B",
                              lambda k=kind, g=group, e=size: collective(k, g, e)))
    if len(devices) >= 2:
        for elements in plan.message_sizes:
            tasks.append((f"transfer {elements * 4} B", lambda e=elements: transfer(e)))
    return tasks


def _memory_bytes(device: Any, n_devices: int) -> float:
    """What one device may allocate: the backend's limit, or on a host (CPU) backend, which
    reports none, the machine's memory shared by its devices."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / n_devices


def hlomap_version() -> str:
    """The installed distribution's version (the package's `__version__` is above this layer)."""
    from importlib import metadata

    try:
        return metadata.version("hlomap")
    except metadata.PackageNotFoundError:
        return ""


#: More samples a caller adds after the microbenchmarks (the pipeline executors' costs,
#: `hlomap.run.calibrate.executor_tasks`): given the chosen devices, the quick flag and the timer,
#: (label, measure) pairs whose measure returns an ExecutorSample, a HandBackSample or None (left out).
ExtraTasks = Callable[[Sequence[Any], bool, Timer], list[Task]]


#: Seconds of large matmuls an accelerator runs before its samples are taken.
WARM_UP_SECONDS = 2.0


def _warm_up(devices: Sequence[Any], seconds: float = WARM_UP_SECONDS) -> None:
    """Keep the devices busy with large matmuls for `seconds`: a GPU idles at a fraction of its
    clock (an H200 at 345 of 1980 MHz) and ramps up under load, so the first samples of a cold
    one come out slow (two calibrations of an H200 back to back fitted 405 and 562 bf16 TFLOP/s)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    blocks = NamedSharding(Mesh(np.asarray(devices), ("x",)), PartitionSpec("x"))
    a = _filled((len(devices), 4096, 4096), jnp.bfloat16, blocks)
    f = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        _ready(f(a))


def default_plan(platform: str, quick: bool = False) -> BenchPlan:
    """The sizes a calibration of devices of `platform` ("cpu", "gpu", "tpu") times: QUICK_PLAN
    with `quick`, DEFAULT_PLAN on host CPUs, ACCELERATOR_PLAN on anything else."""
    if quick:
        return QUICK_PLAN
    return DEFAULT_PLAN if platform == "cpu" else ACCELERATOR_PLAN


def host_bytes_needed(plan: BenchPlan, count: int) -> float:
    """About the peak host memory a calibration of `count` host CPU devices holds: its largest
    all-gather (every device receives every device's largest message), or the compute samples'
    inputs, all held while their passes run (`interleaved_passes`), with the largest output,
    whichever is more."""
    gather = count * count * max(plan.message_sizes, default=0) * 4.0
    side = max(plan.matmul_sizes)
    inputs = (sum(plan.memory_sizes) + len(plan.dtypes) * sum(n * n for n in plan.matmul_sizes)
              + sum(side * side + side * w for w in plan.narrow_dot_widths))
    output = max(max(plan.memory_sizes), side * side)
    return max(gather, count * 4.0 * (inputs + output))


def _free_host_bytes() -> float | None:
    """Host memory free now (None where the system does not say)."""
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _check_host_memory(plan: BenchPlan, count: int) -> None:
    """Simulated host devices live in this process's memory: refuse a calibration that would not
    fit (the kernel would kill the process without a word) before measuring anything."""
    needed = host_bytes_needed(plan, count)
    free = _free_host_bytes()
    if free is not None and needed > 0.8 * free:
        raise CalibrationError(
            f"calibrating {count} host CPU devices needs about {needed / 2**30:.1f} GiB of memory (the largest "
            f"all-gather gives every device {count} messages of {max(plan.message_sizes) * 4 / 2**20:g} MiB); "
            f"{free / 2**30:.1f} GiB are free: measure fewer devices"
            + (", or run the quick calibration (--quick)" if host_bytes_needed(QUICK_PLAN, count) < needed else ""))


def measure_devices(devices: int | None = None, *, quick: bool = False, plan: BenchPlan | None = None,
                    on_progress: Callable[[BenchProgress], None] | None = None,
                    extra_tasks: ExtraTasks | None = None) -> ClusterCalibration:
    """Time every microbenchmark on the first `devices` of JAX's devices (all when None) and
    return the samples with where and when they were taken. `plan` overrides the default (or,
    with `quick`, the quick) sizes; `extra_tasks` adds the executor samples."""
    import jax

    available = jax.devices()
    count = len(available) if devices is None else devices
    if not 1 <= count <= len(available):
        raise CalibrationError(f"cannot calibrate {count} devices: JAX sees {len(available)} "
                               f"({jax.default_backend()})")
    chosen = available[:count]
    bench = plan or default_plan(chosen[0].platform, quick)
    if chosen[0].platform == "cpu":
        _check_host_memory(bench, count)
    if chosen[0].platform != "cpu" and not quick:
        _warm_up(chosen)
    tasks = _tasks(bench, chosen) + (extra_tasks(chosen, quick, _sample_seconds) if extra_tasks else [])
    kernels: list[Measurement] = []
    comm: list[CommSample] = []
    executors: list[ExecutorSample] = []
    hand_backs: list[HandBackSample] = []
    load_before = load_average()[0]
    start = time.perf_counter()
    for i, (label, measure) in enumerate(tasks):
        sample = measure()
        if isinstance(sample, Measurement):
            kernels.append(sample)
        elif isinstance(sample, CommSample):
            comm.append(sample)
        elif isinstance(sample, ExecutorSample):
            executors.append(sample)
        elif isinstance(sample, HandBackSample):
            hand_backs.append(sample)
        if sample is not None:
            log.debug("%s: %.3g s", label, sample.seconds)
        if on_progress is not None:
            on_progress(BenchProgress(i + 1, len(tasks), label))
    return ClusterCalibration(
        backend=jax.default_backend(), device_kind=chosen[0].device_kind, n_devices=count,
        memory_bytes=_memory_bytes(chosen[0], count), kernels=tuple(kernels), comm=tuple(comm),
        jax_version=jax.__version__, hlomap_version=hlomap_version(),
        measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        wall_seconds=time.perf_counter() - start, executors=tuple(executors), hand_backs=tuple(hand_backs),
        load_average=(load_before, load_average()[0]), cores=os.cpu_count() or 0)
