"""Two local processes with 4 CPU devices each (`jax.distributed` over localhost, gloo): a hybrid
plan whose data axis spans the processes, and the spmd executor with its stage axis across them,
compute what the same plans compute in one process on 8 devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path: Path) -> None:
    from tests.run.multihost_plans import run_both

    port = _free_port()
    out = tmp_path / "process0.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    workers = [subprocess.Popen([sys.executable, "-m", "tests.run.multihost_worker", str(i), str(port), str(out)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    logs = []
    for worker in workers:
        try:
            logs.append(worker.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for w in workers:
                w.kill()
            pytest.fail("the two-process run did not finish in 10 minutes")
    for worker, log in zip(workers, logs):
        assert worker.returncode == 0, log[-3000:]
    two = dict(np.load(out))
    one = run_both()  # the same plans in this process, on 8 local devices
    assert set(two) == set(one)
    for key in sorted(one):
        scale = max(float(np.max(np.abs(one[key]))), 1e-6)
        np.testing.assert_allclose(two[key], one[key], rtol=0, atol=1e-5 * scale, err_msg=key)
