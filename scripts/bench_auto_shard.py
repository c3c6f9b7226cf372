"""What `@hlomap.auto_shard` costs: the second call's overhead over a hand-written `jax.jit` of the
same plan, and a cache hit in a new process.

    python scripts/bench_auto_shard.py                       # gpt-tiny, opp on 8 CPU devices
    python scripts/bench_auto_shard.py --model gpt-small --steps 5

1. In this process: the decorated step explores (small budget) and caches its plan; then
   `--steps` steady steps of the decorated step and of `jax.jit(step, in_shardings=the plan's,
   out_shardings=the state's, donate_argnums=(0, 1))` alternate (other processes share the CPU),
   each timed to completion; medians, and the medians of the time to return (dispatch).
2. In a new process with the same cache: the first call's capture, cache lookup (no search),
   compile-and-step, and a steady step; compile = first call - steady step.
3. In another new process, the hand-written `jax.jit` of the cached plan: its first call (trace,
   lower, compile, step) and a steady step. The cache hit's cost beyond compiling is the
   difference of the two kinds of processes' median times to the first step's result, each less its own steady
   step: what the decorator adds to what `jax.jit` pays anyway (tracing the step included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STARTED = time.perf_counter()
import jax  # noqa: E402

import hlomap  # noqa: E402
from hlomap import zoo  # noqa: E402

IMPORTED = time.perf_counter()


def decorated(model: str, cache_dir: str, task: str, mesh: int) -> hlomap.autoshard.AutoShardedStep:
    return hlomap.auto_shard(mesh=mesh, cluster="A", task=task, agent="greedy", budget_seconds=10,
                             cache_dir=cache_dir)(zoo.get(model).train_step())


def hand_written(step: hlomap.autoshard.AutoShardedStep, args: tuple) -> object:
    """`jax.jit` with the plan's shardings, as a user would write it."""
    from hlomap.verify.mesh import plan_mesh

    plan = step.plan
    mesh = plan_mesh(plan)
    shardings = plan.shardings(mesh, like=args)
    return jax.jit(step.__wrapped__, in_shardings=shardings, out_shardings=(shardings[0], shardings[1], None),
                   donate_argnums=(0, 1)), shardings


def timed(fn, state: tuple, batch: object) -> tuple[tuple, float, float]:
    start = time.perf_counter()
    out = fn(state[0], state[1], batch)
    returned = time.perf_counter()
    jax.block_until_ready(out)
    return (out[0], out[1]), time.perf_counter() - start, returned - start


def parent(args: argparse.Namespace) -> None:
    cache = tempfile.mkdtemp(prefix="hlomap-bench-cache-")
    model = zoo.get(args.model)
    params, opt_state, batch = model.example_args(seed=0)
    step = decorated(args.model, cache, args.task, args.mesh)
    start = time.perf_counter()
    out = step(*step.place(params, opt_state), batch)
    jax.block_until_ready(out)
    print(f"{args.model}, task {args.task}, mesh {step.plan.mesh_shape}: first call {time.perf_counter() - start:.2f} s "
          f"({step.timings})")
    ours = (out[0], out[1])
    params, opt_state, batch = model.example_args(seed=0)
    jitted, shardings = hand_written(step, (params, opt_state, batch))
    theirs = (jax.device_put(params, shardings[0]), jax.device_put(opt_state, shardings[1]))
    theirs, _, _ = timed(jitted, theirs, batch)  # compile
    mine, hand, mine_dispatch, hand_dispatch = [], [], [], []
    for _ in range(args.steps):
        ours, total, dispatch = timed(step, ours, batch)
        mine.append(total)
        mine_dispatch.append(dispatch)
        theirs, total, dispatch = timed(jitted, theirs, batch)
        hand.append(total)
        hand_dispatch.append(dispatch)
    m, h = statistics.median(mine), statistics.median(hand)
    print(f"steady step, median of {args.steps}: auto_shard {m * 1e3:.2f} ms, hand-written jax.jit {h * 1e3:.2f} ms, "
          f"overhead {100 * (m - h) / h:+.2f}%")
    md, hd = statistics.median(mine_dispatch), statistics.median(hand_dispatch)
    print(f"time to return (dispatch), median: auto_shard {md * 1e6:.0f} us, jax.jit {hd * 1e6:.0f} us, "
          f"difference {1e6 * (md - hd):.0f} us")
    children, hand_children = [], []
    for _ in range(args.hit_repeats):  # alternating, so that other load falls on both alike
        children.append(_run_child(["--child", cache, "--model", args.model, "--task", args.task,
                                    "--mesh", str(args.mesh)]))
        hand_children.append(_run_child(["--child", cache, "--hand", "--model", args.model]))
    child = children[0]
    compile_s = child["first_call"] - child["step"]
    print(f"new process, cache hit (origin {child['origin']}): capture {child['capture']:.3f} s, cache lookup "
          f"{child['lookup'] * 1e3:.1f} ms, search {child['explore']:.3f} s, compile {compile_s:.2f} s, step "
          f"{child['step']:.3f} s (import hlomap+jax {child['import']:.2f} s, example arguments {child['args']:.2f} s "
          f"not counted)")
    ours_first = [c["to_first"] - c["step"] for c in children]
    hand_first = [c["to_first"] - c["step"] for c in hand_children]
    print(f"new processes ({args.hit_repeats} of each), time to the first step's result less a steady step: auto_shard "
          f"(cache hit) {_seconds(ours_first)}, hand-written jax.jit of the same plan {_seconds(hand_first)}; "
          f"the decorator's cost beyond compiling, median {statistics.median(ours_first) - statistics.median(hand_first):+.2f} s")


def _seconds(values: list[float]) -> str:
    return "median " + f"{statistics.median(values):.2f} s (" + ", ".join(f"{v:.2f}" for v in values) + ")"


def _run_child(flags: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_hand(args: argparse.Namespace) -> None:
    """The hand-written jit of the plan cached in `args.child`, in a fresh process."""
    from hlomap.plan import Plan

    (path,) = Path(args.child).glob("*.plan.json")
    plan = Plan.load(path)
    model = zoo.get(args.model)
    params, opt_state, batch = model.example_args(seed=0)

    class Cached:  # what hand_written reads of a decorated step
        def __init__(self) -> None:
            self.plan, self.__wrapped__ = plan, model.train_step()

    start = time.perf_counter()
    jitted, shardings = hand_written(Cached(), (params, opt_state, batch))
    state = (jax.device_put(params, shardings[0]), jax.device_put(opt_state, shardings[1]))
    state, _, _ = timed(jitted, state, batch)
    to_first = time.perf_counter() - start
    _, seconds, _ = timed(jitted, state, batch)
    print(json.dumps({"to_first": to_first, "step": seconds}))


def child(args: argparse.Namespace) -> None:
    model = zoo.get(args.model)
    start = time.perf_counter()
    params, opt_state, batch = model.example_args(seed=0)
    made = time.perf_counter() - start
    step = decorated(args.model, args.child, args.task, args.mesh)
    start = time.perf_counter()
    out = step(*step.place(params, opt_state), batch)
    jax.block_until_ready(out)
    to_first = time.perf_counter() - start
    _, seconds, _ = timed(step, (out[0], out[1]), batch)
    t = step.timings
    print(json.dumps({"origin": step.origin.value, "capture": t.capture, "lookup": t.lookup, "explore": t.explore,
                      "first_call": t.first_call, "step": seconds, "args": made, "to_first": to_first,
                      "import": IMPORTED - STARTED}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--task", default="opp", help="an SPMD task (opp, adp, hybrid): the hand-written jit is one program")
    parser.add_argument("--mesh", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hit-repeats", type=int, default=3, help="new processes of each kind for the cache hit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    (parent if not arguments.child else child_hand if arguments.hand else child)(arguments)
