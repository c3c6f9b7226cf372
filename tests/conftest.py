"""Every test sees 8 simulated CPU devices.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before anything imports jax.
pytest imports conftest.py before collecting test modules, which is early enough.
"""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# The default run draws the same examples every time, so that a passing suite passes again in CI;
# `HYPOTHESIS_PROFILE=explore` draws new ones (how the subnormal SumTree case was found).
settings.register_profile("default-run", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default-run"))

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The shared corpus beside the checkout (../shared/corpus); tests needing it skip without it."""
    if not CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    return CORPUS


@pytest.fixture(scope="session")
def zoo_capture():
    """name -> Capture of the zoo entry's train step (memoized)."""
    import hlomap
    from hlomap import zoo

    cache: dict[str, Any] = {}

    def get(name: str):
        if name not in cache:
            entry = zoo.get(name)
            cache[name] = hlomap.capture(entry.train_step(), *entry.abstract_args())
        return cache[name]

    return get


@pytest.fixture(scope="session")
def zoo_graph(zoo_capture):
    """name -> FactorGraph of the zoo entry's train step (memoized)."""
    from hlomap.propagation import FactorGraph

    cache: dict[str, Any] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = FactorGraph.from_capture(zoo_capture(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def cap_of() -> Callable[[str], Any]:
    """zoo name -> Capture (memoized for the session)."""
    from hlomap.api import load_source

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = load_source(f"zoo:{name}")
        return cache[name]

    return get


@pytest.fixture(scope="session")
def graph_of(cap_of: Callable[[str], Any]) -> Callable[[str], Any]:
    """zoo name -> FactorGraph (memoized for the session)."""
    from hlomap.propagation.graph import FactorGraph

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = FactorGraph.from_capture(cap_of(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def axes8() -> Any:
    from hlomap.propagation.conflicts import MeshAxes

    return MeshAxes.from_mesh({"model": 8})


@pytest.fixture(scope="session")
def axes2x4() -> Any:
    from hlomap.propagation.conflicts import MeshAxes

    return MeshAxes.from_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="session", autouse=True)
def local_cluster_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder for the whole session ($HLOMAP_CACHE_DIR: tests never write the user's
    ~/.cache) holding the `local` cluster of the present devices (`tests.local_cluster`), so that
    no test measures the machine. Tests of the first-use measurement pass their own folder."""
    from hlomap.run.local import CACHE_ENV
    from tests.local_cluster import seed_local_cluster

    folder = tmp_path_factory.mktemp("hlomap-cache")
    os.environ[CACHE_ENV] = str(folder)
    seed_local_cluster(folder)
    return folder
