"""First-call time of a pipelined step against plain `jax.jit`, with and without stages sharing
one compiled executable, and the per-step cost of the spmd executor's
conversion of its rows into the user's pytrees.

    python scripts/bench_first_call.py                  # gpt-tiny and a 4-layer decoder, 8 CPU devices
    python scripts/bench_first_call.py --stages 5 --microbatches 4

Each figure comes from a fresh process (no compiled program survives from another run):
- `jit`: `jax.jit(train_step)`'s first call (trace, lower, compile, run), blocked on its result;
- `mpmd-compile-each` (before) and `mpmd-shared` (after): the first call of
  `hlomap.parallelize(step, plan, executor="mpmd")` on a plan of `--stages` stages cut between
  layers (1F1B), the step cut with `example_args` beforehand (its time, `cut`, printed apart),
  with how many executables were compiled and how many loaded for another stage's devices;
- `spmd executor conversion`: a steady step of the spmd executor (GPipe plan, same stages) fed
  its own outputs, against the same step on its rows (`Staged`), medians of interleaved rounds.
Other processes may share the machine: the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = ("gpt-tiny", "decoder-4")
VARIANTS = ("jit", "mpmd-compile-each", "mpmd-shared", "spmd-conversion")


def _model(name: str):  # noqa: ANN202 -- a zoo model
    from dataclasses import replace

    from hlomap import zoo

    if name == "decoder-4":  # gpt-tiny's layer, 4 of them, batch 8
        tiny = zoo.get("gpt-tiny")
        return replace(tiny, name="decoder-4", config=replace(tiny.config, num_layers=4, batch_size=8))
    return zoo.get(name)


def _plan(model, stages: int, microbatches: int, schedule: str):  # noqa: ANN001, ANN202
    """A plan of `stages` stages cut between layers, 8 // stages devices each (the explorer
    would pick its own stage count): the runner tests' plans (`tests/run/helpers.py`)."""
    import hlomap
    from tests.run.helpers import boundary_pivots, chain_of, pipeline_plan

    start = time.perf_counter()
    cap = hlomap.capture(model.train_step(), *model.abstract_args())
    captured = time.perf_counter()
    chain = chain_of(cap)
    plan = pipeline_plan(cap, chain, boundary_pivots(chain, stages - 1), microbatches=microbatches, schedule=schedule,
                         devices_per_stage=8 // stages)
    return plan, captured - start, time.perf_counter() - captured


def _block(out) -> None:  # noqa: ANN001
    import jax

    jax.block_until_ready(out)


def run_one(name: str, variant: str, stages: int, microbatches: int) -> dict:
    import jax
    import numpy as np

    import hlomap

    model = _model(name)
    args = model.example_args(seed=0)
    if variant == "jit":
        start = time.perf_counter()
        _block(jax.jit(model.train_step())(*args))
        return {"first_call": time.perf_counter() - start}
    if variant == "spmd-conversion":
        return _conversion(model, args, stages, microbatches)
    if variant == "mpmd-compile-each":  # before: every stage compiles its own programs
        from hlomap.run.pipeline import shared_compile

        def compile_each(cache: shared_compile.ExecutableCache, lowered, mesh):  # noqa: ANN001, ANN202
            cache.compiled += 1
            return lowered.compile()

        shared_compile.ExecutableCache.executable = compile_each
    plan, capture_s, search_s = _plan(model, stages, microbatches, "1f1b")
    cut = time.perf_counter()
    step = hlomap.parallelize(model.train_step(), plan, executor="mpmd", example_args=args)
    cut_s = time.perf_counter() - cut
    host = jax.tree.map(np.asarray, args)
    start = time.perf_counter()
    _block(step(*host))
    first = time.perf_counter() - start
    cache = step._runner.executables
    return {"first_call": first, "capture": capture_s, "plan": search_s, "cut": cut_s,
            "stages": len(plan.pipeline.stages), "compiled": cache.compiled, "loaded": cache.loaded}


def _conversion(model, args, stages: int, microbatches: int, rounds: int = 15) -> dict:  # noqa: ANN001
    import jax
    import numpy as np

    import hlomap

    plan, _, _ = _plan(model, stages, microbatches, "gpipe")
    step = hlomap.parallelize(model.train_step(), plan, executor="spmd", example_args=args)
    runner = step._runner
    host = jax.tree.map(np.asarray, args)
    trees = step(*host)[:2]  # the user's pytrees
    rows = runner._stage_state(*step(*trees, host[2])[:2])  # and the rows they came from
    rows = runner._step_jit(*rows, *runner._put_arguments(host[2:]))[:2]
    times: dict[str, list[float]] = {"user pytrees": [], "rows": []}
    for _ in range(rounds):
        start = time.perf_counter()
        out = step(*trees, host[2])
        _block(out)
        times["user pytrees"].append(time.perf_counter() - start)
        trees = out[:2]
        start = time.perf_counter()
        out = runner._step_jit(*rows, *runner._put_arguments(host[2:]))
        _block(out)
        times["rows"].append(time.perf_counter() - start)
        rows = out[:2]
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(trees))
    return {"step_user_pytrees": statistics.median(times["user pytrees"]), "step_rows": statistics.median(times["rows"]),
            "state_bytes": state_bytes, "stages": len(plan.pipeline.stages)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"of {', '.join(MODELS)} or a zoo name")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every variant (default 3)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.stages, args.microbatches)))
        return
    print(f"load average before: {os.getloadavg()}")
    first_calls: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.repeats):  # rounds of every variant, so a burst of load hits them alike
        for name in args.models:
            for variant in VARIANTS:
                done = subprocess.run([sys.executable, __file__, "--one", name, variant, "--stages", str(args.stages),
                                       "--microbatches", str(args.microbatches)], capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{name} {variant}: failed\n{done.stderr[-2000:]}")
                    continue
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                if "first_call" in figures:
                    first_calls.setdefault((name, variant), []).append(figures["first_call"])
                shown = ", ".join(f"{k} {v:.3f} s" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
                print(f"round {round_} {name:10s} {variant:18s} {shown}")
    print("first call, median over rounds:")
    for (name, variant), times in first_calls.items():
        print(f"  {name:10s} {variant:18s} {statistics.median(times):.3f} s  ({', '.join(f'{t:.2f}' for t in times)})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
