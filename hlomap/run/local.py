"""The `local` cluster: the calibrated cluster of the devices JAX sees, cached on disk.

`hlomap.load_cluster("local")` (so `--cluster local`, `cluster="local"` and `auto_shard`'s
default, which every verb of `hlomap.api` resolves) asks this module for it. It lives in `run`
because measuring times the pipeline executors too (`hlomap.run.calibrate`). The first use on a
machine measures the devices (`hlomap calibrate`'s microbenchmarks, about half a minute on 8 CPU
devices) with a one-line notice on stderr and keeps the cluster file in
`$HLOMAP_CACHE_DIR/clusters/` (default `~/.cache/hlomap/clusters/`); later uses read it. The
file is valid for one `LocalKey`: the backend, the device kind and count, the JAX and hlomap
versions and the calibration's own version: another GPU, another device count or an upgrade
measures again. `hlomap calibrate --local` (or `local_cluster(refresh=True)`) measures again on
demand.

A cache folder that cannot be written only warns: the cluster is then measured once per process.
A cached file that cannot be read is measured again, with a warning naming it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hlomap.cost.calibration import CLUSTER_VERSION as CALIBRATION_VERSION
from hlomap.cost.cluster import LOCAL, LOCAL_CPU_DEVICES, Cluster, ClusterSpecError

#: Where cached plans and clusters live unless $HLOMAP_CACHE_DIR says otherwise.
DEFAULT_CACHE_DIR = "~/.cache/hlomap"
CACHE_ENV = "HLOMAP_CACHE_DIR"
#: The folder of the cache holding calibrated clusters.
CLUSTERS_FOLDER = "clusters"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


@dataclass(frozen=True)
class LocalKey:
    """What a cached local cluster was measured on; any difference measures again."""

    backend: str
    device_kind: str
    n_devices: int
    jax_version: str
    hlomap_version: str
    calibration_version: int = CALIBRATION_VERSION  # what the microbenchmarks measure, and how

    def file_name(self) -> str:
        """`<backend>-<kind>-<count>-jax<version>-hlomap<version>-v<calibration>.cluster.json`,
        file-system safe."""
        raw = (f"{self.backend}-{self.device_kind}-{self.n_devices}-jax{self.jax_version}-hlomap{self.hlomap_version}"
               f"-v{self.calibration_version}")
        return re.sub(r"[^A-Za-z0-9_.+-]+", "_", raw) + ".cluster.json"

    def describe(self) -> str:
        return f"{self.n_devices} {self.backend} device(s) ({self.device_kind})"


def present_key() -> LocalKey:
    """The key of the devices JAX sees now (starting JAX: on a CPU-only machine that has not
    started it yet, with `LOCAL_CPU_DEVICES` host devices)."""
    from hlomap.verify.mesh import ensure_host_devices

    ensure_host_devices(LOCAL_CPU_DEVICES)
    import jax

    from hlomap.verify.devices import hlomap_version

    devices = jax.devices()
    return LocalKey(jax.default_backend(), devices[0].device_kind, len(devices), jax.__version__, hlomap_version())


def cached_path(key: LocalKey, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / CLUSTERS_FOLDER / key.file_name()


def read_cached(path: Path) -> Cluster | None:
    """The cluster cached at `path`; None when there is none or it cannot be read (with a warning
    naming the file: it is measured again and overwritten)."""
    if not path.is_file():
        return None
    try:
        return Cluster.from_json(json.loads(path.read_text()), source=str(path))
    except (OSError, ValueError, ClusterSpecError) as err:
        warnings.warn(f"hlomap: ignoring the unreadable local cluster {path} ({err}); measuring the devices again",
                      RuntimeWarning, stacklevel=3)
        return None


def notice(message: str) -> None:
    print(f"hlomap: {message}", file=sys.stderr, flush=True)


Measure = Callable[[int], Any]  # device count -> ClusterCalibration


def _measure(count: int) -> Any:
    from hlomap.run.calibrate import measure_present_devices

    return measure_present_devices(count)


#: Clusters measured in this process for keys whose cache could not be written: measured once.
_IN_MEMORY: dict[LocalKey, Cluster] = {}


def local_cluster(*, refresh: bool = False, cache_dir: Path | None = None, measure: Measure = _measure,
                  key: LocalKey | None = None, on_notice: Callable[[str], None] = notice) -> Cluster:
    """The calibrated cluster of the devices JAX sees (module docstring). `measure` and `key` are
    the devices' microbenchmarks and identity (tests inject both)."""
    from hlomap.cost.calibration import calibrated_cluster_json
    from hlomap.plan import write_atomic

    key = key or present_key()
    path = cached_path(key, cache_dir)
    if not refresh:
        cached = read_cached(path) or _IN_MEMORY.get(key)
        if cached is not None:
            return cached
    on_notice(f"measuring the {key.describe()} for cluster 'local' (once; cached in {path.parent})")
    calibration = measure(key.n_devices)
    busy = calibration.busy_warning()
    if busy:  # cached for later runs too: say how to take it again
        on_notice(f"{busy} (`hlomap calibrate --local`)")
    data = calibrated_cluster_json(calibration, name=LOCAL)
    cluster = Cluster.from_json(data, source="local calibration")
    problem = folder_problem(path.parent)
    if problem is None:
        write_atomic(path, json.dumps(data, indent=1) + "\n")
    else:
        warnings.warn(f"hlomap: cannot cache the local cluster in {path.parent} ({problem}); it is measured again "
                      f"in each process (set ${CACHE_ENV} to a writable folder)", RuntimeWarning, stacklevel=2)
        _IN_MEMORY[key] = cluster
    return cluster


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be cached in `folder` (created if missing), or None when they can: the
    one check of the cache folder, for clusters here and for `auto_shard`'s plans."""
    from hlomap.plan import write_problem

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return err.strerror or str(err)
    return write_problem(folder)
