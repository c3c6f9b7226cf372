"""The `local` cluster tests use: a calibration of this project's CI machine (8 host CPU devices,
`hlomap calibrate`, tests/data/clusters/cpu8.cluster.json) put where `cluster="local"` reads it,
so that no test spends half a minute measuring a noisy machine."""

from __future__ import annotations

from pathlib import Path

LOCAL_CLUSTER_FILE = Path(__file__).resolve().parent / "data" / "clusters" / "cpu8.cluster.json"


def seed_local_cluster(cache_dir: Path) -> Path:
    """Write the CI machine's calibration as the present devices' `local` cluster in `cache_dir`."""
    from hlomap.run.local import cached_path, present_key

    path = cached_path(present_key(), cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(LOCAL_CLUSTER_FILE.read_text())
    return path
