"""The `local` cluster: measured on first use, cached per LocalKey, read back, measured again
on demand; errors and unwritable folders never lose the measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlomap.api import load_cluster
from hlomap.cost.cluster import LOCAL, Cluster, ClusterSpecError
from hlomap.cost.cluster import load_cluster as load_datasheet_cluster
from hlomap.run import local
from hlomap.run.local import LocalKey, cached_path, local_cluster, present_key
from tests.cost.test_calibration_cluster import _calibration

KEY = LocalKey("cpu", "cpu", 4, "0.0", "0.1.0")


class Counting:
    """A measuring function that counts its calls and returns a synthetic 4-device calibration."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, count: int):
        self.calls += 1
        return _calibration(count)


def test_a_calibration_taken_on_a_busy_machine_says_so_and_keeps_its_load_average(tmp_path: Path) -> None:
    """The 1-minute load average at the start and end of a calibration, and the host's cores, are
    kept in the file; a start above half the cores (other work only adds time) earns a warning,
    which the `local` cluster's first use passes on with how to measure again."""
    import dataclasses

    from hlomap.cost.calibration import ClusterCalibration

    idle = dataclasses.replace(_calibration(4), load_average=(0.4, 2.1), cores=2)
    busy = dataclasses.replace(idle, load_average=(1.8, 2.6))
    assert idle.busy_warning() is None and _calibration(4).busy_warning() is None
    warning = busy.busy_warning()
    assert warning is not None and "1.80 on 2 cores" in warning and "calibrate again" in warning
    again = ClusterCalibration.from_json(busy.to_json(), source="test")
    assert again.load_average == (1.8, 2.6) and again.cores == 2
    notices: list[str] = []
    local_cluster(cache_dir=tmp_path, measure=lambda n: busy, key=KEY, on_notice=notices.append)
    assert len(notices) == 2 and "busy" in notices[1] and "hlomap calibrate --local" in notices[1]


def test_first_use_measures_once_with_a_notice_then_reads_the_cache(tmp_path: Path) -> None:
    measure, notices = Counting(), []
    first = local_cluster(cache_dir=tmp_path, measure=measure, key=KEY, on_notice=notices.append)
    assert measure.calls == 1 and len(notices) == 1 and "4 cpu device(s)" in notices[0]
    path = cached_path(KEY, tmp_path)
    assert path.is_file() and path.parent.name == "clusters"
    again = local_cluster(cache_dir=tmp_path, measure=measure, key=KEY, on_notice=notices.append)
    assert measure.calls == 1 and len(notices) == 1
    assert again == first and first.name == LOCAL and first.n_devices == 4
    # the cached file is an ordinary cluster file: any --cluster FILE reader loads it
    assert load_cluster(path) == first
    assert "calibration" in json.loads(path.read_text())


def test_refresh_and_another_key_measure_again(tmp_path: Path) -> None:
    measure = Counting()
    local_cluster(cache_dir=tmp_path, measure=measure, key=KEY, on_notice=lambda m: None)
    local_cluster(cache_dir=tmp_path, measure=measure, key=KEY, on_notice=lambda m: None, refresh=True)
    assert measure.calls == 2
    upgraded = LocalKey("cpu", "cpu", 4, "0.0", "0.2.0")
    local_cluster(cache_dir=tmp_path, measure=measure, key=upgraded, on_notice=lambda m: None)
    assert measure.calls == 3
    assert cached_path(upgraded, tmp_path) != cached_path(KEY, tmp_path)


def test_a_corrupt_cache_entry_is_named_and_measured_again(tmp_path: Path) -> None:
    path = cached_path(KEY, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    measure = Counting()
    with pytest.warns(RuntimeWarning, match="unreadable local cluster .*clusters"):
        cluster = local_cluster(cache_dir=tmp_path, measure=measure, key=KEY, on_notice=lambda m: None)
    assert measure.calls == 1 and cluster.n_devices == 4
    assert Cluster.from_json(json.loads(path.read_text())) == cluster  # overwritten with the new one


def test_an_unwritable_cache_warns_and_measures_once_per_process(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(local, "_IN_MEMORY", {})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    measure = Counting()
    with pytest.warns(RuntimeWarning, match="cannot cache the local cluster"):
        local_cluster(cache_dir=blocker, measure=measure, key=KEY, on_notice=lambda m: None)
    local_cluster(cache_dir=blocker, measure=measure, key=KEY, on_notice=lambda m: None)
    assert measure.calls == 1


def test_key_file_names_are_safe() -> None:
    name = LocalKey("gpu", "NVIDIA H100 80GB HBM3", 8, "0.10.2", "0.1.0").file_name()
    assert "/" not in name and " " not in name and name.endswith(".cluster.json")


def test_load_cluster_local_is_the_present_devices() -> None:
    """The session's cache (tests/conftest.py) holds the present devices' local cluster."""
    cluster = load_cluster("local")
    assert cluster.name == LOCAL and cluster.n_devices == present_key().n_devices == 8
    assert load_cluster(" LOCAL ") == cluster
    import hlomap

    assert hlomap.load_cluster is load_cluster  # the public name measures too
    # the cost model cannot run the devices: it names where `local` is loaded
    with pytest.raises(ClusterSpecError, match=r"hlomap.load_cluster\('local'\)"):
        load_datasheet_cluster("local")


def test_cli_local_cluster(capsys) -> None:
    from hlomap.cli import run

    assert run(["simulate", "zoo:gpt-tiny", "--plan", "dp", "--cluster", "local"]) == 0
    assert "local" in capsys.readouterr().out
    assert run(["calibrate", "--local", "--devices", "2"]) == 2
    assert "--devices does not apply" in capsys.readouterr().err


def test_auto_shard_plans_for_the_local_devices_by_default() -> None:
    import hlomap

    step = hlomap.auto_shard(lambda p, o, b: (p, o, 0.0), cache=False)
    assert step.config.cluster == "local"


def test_cli_calibrate_local_on_a_fresh_machine_makes_the_cache_folder(tmp_path: Path, monkeypatch,
                                                                     capsys) -> None:
    """A new machine has no ~/.cache/hlomap yet: `hlomap calibrate --local` creates it and saves
    (the measuring is stubbed with the CI machine's calibration; the CLI path is what is tested)."""
    from hlomap import api
    from hlomap.cli import run
    from hlomap.cost.calibration import ClusterCalibration
    from hlomap.run.local import CACHE_ENV
    from tests.local_cluster import LOCAL_CLUSTER_FILE

    calibration = ClusterCalibration.from_json(json.loads(LOCAL_CLUSTER_FILE.read_text())["calibration"])
    fresh = tmp_path / "never-made" / "cache"
    monkeypatch.setenv(CACHE_ENV, str(fresh))
    monkeypatch.setattr(api, "calibrate", lambda *a, **k: (load_cluster(LOCAL_CLUSTER_FILE), calibration))
    assert run(["calibrate", "--local", "--quiet"]) == 0
    saved = cached_path(present_key(), fresh)
    assert saved.is_file() and f"wrote {saved}" in capsys.readouterr().err
    assert load_cluster(saved).n_devices == 8
    # a cache folder that cannot be made is named, not a traceback
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    assert run(["calibrate", "--local", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the cache folder" in err and "HLOMAP_CACHE_DIR" in err and "Traceback" not in err
