"""Flax NNX modules as pure (params dict -> loss) functions.

The zoo's Flax families define an `nnx.Module` and a forward-loss on it. hlomap needs a pure
step over a plain nested dict, so a module is split once (abstractly, with `nnx.eval_shape`) into
its static graph definition and its variables; the loss merges a graph definition with the dicts
it is given. Trainable variables (`nnx.Param`) become the params dict, batch statistics
(`nnx.BatchStat`) the `OTHER_KEY` state.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
from flax import nnx

from hlomap.zoo.model import OTHER_KEY, Batch, LossFn, Params, ZooError


class ParamKeys(Protocol):
    """The part of `nnx.Rngs` that Flax's layers use while they are built: `rngs.params()`."""

    def params(self) -> jax.Array: ...


class KeyStream:
    """A stand-in for `nnx.Rngs(params=key)` whose counter is a Python int.

    Why: `nnx.Rngs` keeps its counter in a Variable, and updating a Variable while tracing
    probes `.sharding` on a tracer, which builds an error message by walking the whole trace so
    far. One probe per parameter makes tracing an initialiser quadratic in model size (bert-48:
    6.7 s under `jax.eval_shape` with `nnx.Rngs`, 0.8 s with this). Flax's layers only ever call
    `rngs.params()` in their constructors, which is all this provides. Key i is
    `fold_in(key, i)`, so parameters are deterministic in the key.
    """

    def __init__(self, key: jax.Array):
        self._key = key
        self._count = 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self._key, self._count)
        self._count += 1
        return key


#: Builds the module from a source of parameter keys (the family config closes over its sizes).
Build = Callable[[ParamKeys], nnx.Module]
#: Runs the module on a batch and returns the scalar loss.
ForwardLoss = Callable[[nnx.Module, Batch], jax.Array]


def _split(module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    graphdef, params, stats, rest = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    leftover = nnx.to_pure_dict(rest)
    if jax.tree_util.tree_leaves(leftover):
        # An RNG stream or a custom variable type would silently become part of no argument.
        raise ZooError(f"module {type(module).__name__} has variables that are neither Param nor "
                       f"BatchStat: {sorted(leftover)}")
    return graphdef, params, stats


def init_params(build: Build, key: jax.Array) -> Params:
    """Build the module from `key` and return its variables as a pure nested dict."""
    _, params, stats = _split(build(KeyStream(key)))
    pure = nnx.to_pure_dict(params)
    if OTHER_KEY in pure:
        raise ZooError(f"a module attribute is named {OTHER_KEY!r}, the key reserved for batch statistics")
    stats_pure = nnx.to_pure_dict(stats)
    return {**pure, OTHER_KEY: stats_pure} if stats_pure else pure


def make_loss(build: Build, forward_loss: ForwardLoss) -> LossFn:
    """Pure `(trainable, other, batch) -> (loss, new_other)` for an NNX module.

    The graph definition comes from an abstract build, so making the loss allocates no weights.
    `new_other` holds the batch statistics the forward pass updated in the merged module.
    """
    graphdef, _, _ = _split(nnx.eval_shape(lambda: build(KeyStream(jax.random.key(0)))))

    def loss(trainable: Params, other: Params, batch: Batch) -> tuple[jax.Array, Params]:
        model = nnx.merge(graphdef, trainable, other) if other else nnx.merge(graphdef, trainable)
        value = forward_loss(model, batch)
        new_other = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)) if other else {}
        return value, new_other

    return loss
