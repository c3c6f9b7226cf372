"""The meta-network that predicts what re-planning gains (AutoPipe's meta-learner), in Flax NNX.

The cost model prices every option exactly under one assumption: that the current resources last.
What it cannot know is how long they will. The meta-network reads the recent history of changes,
an LSTM over the last `HISTORY` of them (per change: the server links' bandwidth and the GPUs as
shares of full strength, the time since the previous change, the time left, and each option's
relative speed and migration time), and predicts for a move and for a re-solve the iterations
they gain over keeping the plan until the trace's horizon, as a share of what the fastest option
trains at today's speed. Its training label is that gain realized on the trace when the option's
plan is held from then on (`hold_gains`), so it learns whether a change tends to last.

The meta policy takes the option with the largest predicted gain (keep when none is positive,
unless keep cannot run). It is trained on generated traces (`train_meta`) and compared with the
exact choice (`policies.arbiter_choice`) in `scripts/bench_replan.py`; the network ships as
`data/gain_lstm.npz` (rebuilt by `scripts/train_replan_meta.py`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hlomap.agents import checkpoint
from hlomap.agents.networks import Params, PureModel, purify
from hlomap.tasks.replan.options import Candidate, Option, RunningPlan, Workload
from hlomap.tasks.replan.policies import ReplanPolicy, Replay, arbiter_choice, run_policy
from hlomap.tasks.replan.trace import ResourceState, Trace

__all__ = ["DEFAULT_NETWORK", "GainNetwork", "MetaPolicy", "GainSample", "hold_gains", "load_network", "samples",
           "save_network", "train_meta"]

log = logging.getLogger(__name__)

DEFAULT_NETWORK = Path(__file__).resolve().parent / "data" / "gain_lstm.npz"
#: Changes the LSTM reads, the current one last.
HISTORY = 8
#: Options whose gains are predicted (keep's is 0 by definition).
PREDICTED = (Option.MOVE, Option.RESOLVE)
FEATURES = 5 + 3 * 3
HIDDEN = 32
_KIND = "replan-gain-network"
LAYOUT_VERSION = 1


class GainNetwork(nnx.Module):
    """LSTM over the change history, then a linear head: one predicted gain per `PREDICTED`."""

    def __init__(self, features: int = FEATURES, hidden: int = HIDDEN, *, rngs: nnx.Rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(features, hidden, rngs=rngs), rngs=False)
        self.head = nnx.Linear(hidden, len(PREDICTED), rngs=rngs)

    def __call__(self, history: jax.Array) -> jax.Array:
        zeros = jnp.zeros((history.shape[0], self.head.in_features), history.dtype)
        return self.head(self.rnn(history, initial_carry=(zeros, zeros))[:, -1])


def _model(seed: int = 0) -> tuple[PureModel, Params]:
    return purify(GainNetwork(rngs=nnx.Rngs(seed)))


# ---------------------------------------------------------------------------------------------
# Features and labels
# ---------------------------------------------------------------------------------------------


def features(now: float, previous: float, horizon: float, state: ResourceState,
             options: Sequence[Candidate]) -> np.ndarray:
    """One change as the LSTM reads it (module docstring)."""
    remaining = max(horizon - now, 1.0)
    links = state.server_bandwidth[~np.eye(len(state.server_bandwidth), dtype=bool)]
    spread = float(links.min() / links.max()) if links.size else 1.0  # slowest link against the fastest
    base = np.array([state.bandwidth_share(), spread, state.gpu_share(),
                     min((now - previous) / (0.05 * horizon), 10.0), remaining / horizon])
    fastest = min((c.step_seconds for c in options), default=math.inf)
    by_option = {c.option: c for c in options}
    rows = []
    for option in (Option.KEEP, *PREDICTED):
        c = by_option.get(option)
        if c is None or not math.isfinite(c.step_seconds):
            rows.append([0.0, 0.0, 0.0])
        else:
            rows.append([1.0, fastest / c.step_seconds, min(c.migration_seconds / remaining, 1.0)])
    return np.concatenate([base, np.asarray(rows).reshape(-1)]).astype(np.float32)


def hold_gains(replay: Replay, i: int, options: Sequence[Candidate]) -> tuple[np.ndarray, np.ndarray]:
    """Labels at change i: for each of `PREDICTED`, the iterations its plan trains from now to the
    horizon when held (blocked first by its migration; stalled where it cannot run), minus keep's,
    as a share of what the fastest option trains at today's speed; and which options exist."""
    now = replay.states[i][0]
    horizon = replay.trace.horizon
    ends = [t for t, _ in replay.states[i + 1:]] + [horizon]
    starts = [now] + [t for t, _ in replay.states[i + 1:]]

    def trained(c: Candidate) -> float:
        total, blocked = 0.0, c.migration_seconds
        for j, (start, end) in enumerate(zip(starts, ends)):
            step = c.step_seconds if j == 0 else replay.step_seconds(i + j, c.plan)
            length = max(end - start - blocked, 0.0)
            blocked = max(blocked - (end - start), 0.0)
            if math.isfinite(step):
                total += length / step
        return total

    fastest = min(c.step_seconds for c in options)
    reference = max(horizon - now, 1.0) / fastest if math.isfinite(fastest) else 1.0
    keep = trained(options[0])
    by_option = {c.option: c for c in options}
    gains, present = np.zeros(len(PREDICTED), np.float32), np.zeros(len(PREDICTED), bool)
    for k, option in enumerate(PREDICTED):
        c = by_option.get(option)
        if c is not None and math.isfinite(c.step_seconds):
            gains[k], present[k] = (trained(c) - keep) / reference, True
    return gains, present


@dataclass(frozen=True)
class GainSample:
    history: np.ndarray   # [HISTORY, FEATURES], zero-padded at the start
    gains: np.ndarray     # [len(PREDICTED)]
    present: np.ndarray   # [len(PREDICTED)] bool
    exact: Option         # the arbiter's choice


def _window(rows: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((HISTORY, FEATURES), np.float32)
    tail = rows[-HISTORY:]
    out[HISTORY - len(tail):] = tail
    return out


def samples(trace: Trace, workload: Workload, initial: RunningPlan) -> list[GainSample]:
    """Training samples of one trace, along the plans the exact arbiter runs."""
    replay = Replay(trace, workload)
    out: list[GainSample] = []
    rows: list[np.ndarray] = []
    previous = 0.0

    def decide(i: int, now: float, state: ResourceState, options: Sequence[Candidate]) -> Candidate:
        nonlocal previous
        rows.append(features(now, previous, trace.horizon, state, options))
        previous = now
        choice = arbiter_choice(now, trace.horizon, options)
        gains, present = hold_gains(replay, i, options)
        out.append(GainSample(_window(rows), gains, present, choice.option))
        return choice

    run_policy(replay, initial, ReplanPolicy.META, chooser=decide)
    return out


# ---------------------------------------------------------------------------------------------
# Training, files, the policy
# ---------------------------------------------------------------------------------------------


def _arrays(data: Sequence[GainSample]) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (jnp.asarray(np.stack([s.history for s in data])), jnp.asarray(np.stack([s.gains for s in data])),
            jnp.asarray(np.stack([s.present for s in data]).astype(np.float32)))


def train_meta(data: Sequence[GainSample], *, validation: Sequence[GainSample] = (), steps: int = 2000,
               learning_rate: float = 3e-3, weight_decay: float = 1e-3, check_every: int = 25, seed: int = 0
               ) -> tuple[Params, float]:
    """Fit the network to the samples' gains (masked mean squared error, full batch, AdamW).
    With `validation` samples, keep the parameters with the least validation loss (checked every
    `check_every` steps); returns them and that loss (else the last parameters and the training
    loss)."""
    model, params = _model(seed)
    x, y, mask = _arrays(data)
    optimizer = optax.adamw(learning_rate, weight_decay=weight_decay)
    state = optimizer.init(params)

    def loss_fn(p: Params, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
        error = (model.apply(p, x) - y) * mask
        return jnp.sum(error**2) / jnp.maximum(jnp.sum(mask), 1.0)

    @jax.jit
    def step(p: Params, s: Any) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y, mask)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    held = _arrays(validation) if validation else None
    evaluate = jax.jit(loss_fn)
    best, best_loss = params, math.inf
    loss = jnp.inf
    for k in range(steps):
        params, state, loss = step(params, state)
        if held is not None and (k + 1) % check_every == 0:
            score = float(evaluate(params, *held))
            if score < best_loss:
                best, best_loss = params, score
    if held is None:
        return params, float(loss)
    return best, best_loss


def save_network(path: str | Path, params: Params, extra: dict[str, Any] | None = None) -> None:
    meta = {"kind": _KIND, "layout": {"version": LAYOUT_VERSION, "history": HISTORY, "features": FEATURES,
                                      "hidden": HIDDEN}, "extra": extra or {}}
    checkpoint.save(path, checkpoint.flatten("params", params), meta)


def load_network(path: str | Path | None = None) -> tuple[PureModel, Params, dict[str, Any]]:
    path = Path(path) if path is not None else DEFAULT_NETWORK
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no re-planning gain network; build one with "
                                f"`python scripts/train_replan_meta.py --out {path}`")
    arrays, meta = checkpoint.load(path)
    expected = {"version": LAYOUT_VERSION, "history": HISTORY, "features": FEATURES, "hidden": HIDDEN}
    if meta.get("kind") != _KIND or meta.get("layout") != expected:
        raise ValueError(f"{path}: not a gain network of this version ({meta.get('kind')}, {meta.get('layout')}); "
                         "retrain it with scripts/train_replan_meta.py")
    model, template = _model()
    return model, checkpoint.unflatten("params", template, arrays), meta


class MetaPolicy:
    """A chooser for `policies.run_policy(..., ReplanPolicy.META)`: the option with the largest predicted gain.
    It also records the exact arbiter's choice at every change (`agreement`)."""

    def __init__(self, horizon: float, network: tuple[PureModel, Params, dict[str, Any]] | None = None):
        model, params, _ = network if network is not None else load_network()
        self.horizon = horizon
        self._predict = jax.jit(model.apply)
        self.params = params
        self.rows: list[np.ndarray] = []
        self.previous = 0.0
        self.choices: list[tuple[Option, Option, bool]] = []  # (meta, exact, same plan)

    def __call__(self, i: int, now: float, state: ResourceState, options: Sequence[Candidate]) -> Candidate:
        self.rows.append(features(now, self.previous, self.horizon, state, options))
        self.previous = now
        predicted = np.asarray(self._predict(self.params, _window(self.rows)[None]))[0]
        by_option = {c.option: c for c in options}
        keep = options[0]
        best, best_gain = (keep, 0.0) if math.isfinite(keep.step_seconds) else (None, -math.inf)
        for option, gain in zip(PREDICTED, predicted):
            c = by_option.get(option)
            if c is not None and math.isfinite(c.step_seconds) and gain > best_gain:
                best, best_gain = c, float(gain)
        choice = best if best is not None else keep
        exact = arbiter_choice(now, self.horizon, options)
        self.choices.append((choice.option, exact.option, choice.plan == exact.plan))
        return choice

    @property
    def agreement(self) -> float:
        """Share of changes where the meta policy chose the plan the exact arbiter would have."""
        return float(np.mean([same for _, _, same in self.choices])) if self.choices else float("nan")

