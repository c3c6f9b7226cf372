"""Big entries lower abstractly; t5-11b (45 GB of float32 weights) does so in a few hundred MB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import hlomap.zoo as zoo

BIG = [name for name in zoo.names() if not name.endswith("-tiny") and name != "haiku-mlp"]
REPO = Path(__file__).resolve().parents[2]
#: Leaf names of the weights that multiply activations (dense and conv kernels, stacked experts).
_MATRIX_NAMES = {"kernel", "wi", "wo"}

#: Run in a fresh interpreter so that ru_maxrss is this lowering's peak, not the test session's.
_MEASURE = """
import json, resource, sys, time
import hlomap.zoo as zoo
entry = zoo.get(sys.argv[1])
start = time.perf_counter()
text = entry.hlo_text()
seconds = time.perf_counter() - start
print(json.dumps({
    "seconds": seconds,
    "instructions": sum(1 for line in text.splitlines() if " = " in line),
    "dots": text.count(" dot("),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "weight_bytes": 4 * entry.param_count(),
}))
"""


def measure_lowering(name: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", _MEASURE, name], capture_output=True, text=True,
                            env=env, timeout=600, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_t5_11b_lowers_without_allocating_weights() -> None:
    report = measure_lowering("t5-11b")
    assert report["weight_bytes"] > 40e9
    # Measured about 0.36 GB; allocating even one copy of the weights would take 45 GB.
    assert report["peak_rss_bytes"] < 4 * 2**30, report
    assert report["dots"] >= 48 * 8  # at least q, k, v, out, wi, wo per layer forward + backward
    assert report["instructions"] > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("name", BIG)
def test_big_entry_lowers_with_one_dot_per_layer_weight(name: str) -> None:
    entry = zoo.get(name)
    args = entry.abstract_args()
    text = entry.lower().as_text(dialect="hlo", debug_info=True)
    entry_text = text[text.index("\nENTRY "):]
    parameters = [line for line in entry_text.splitlines() if " parameter(" in line]
    assert len(parameters) == len(jax.tree_util.tree_leaves(args))
    assert "transpose(jvp(" in text
    forward = [line for line in text.splitlines()
               if (" dot(" in line or " convolution(" in line) and "transpose(jvp(" not in line]
    weights = [path for path in zoo.tree_paths(args[0]) if path.rsplit("/", 1)[-1] in _MATRIX_NAMES]
    assert weights
    # Unrolled layers: every kernel feeds its own forward dot or convolution.
    assert len(forward) >= len(weights), (len(forward), len(weights))
