"""`ZooModel`: one benchmark training step with its abstract and example arguments.

A zoo entry is a name, a family and a frozen config. The config is the architecture: it knows
how to initialise the parameters, how to compute the loss and what a batch looks like (the
`Architecture` protocol). Everything that is the same for every family — the Adam train step,
building abstract arguments with `jax.eval_shape`, making real example arguments, lowering to
HLO text — lives here, once.

Parameters are a nested dict pytree whose paths read like `layers_0/attn/query/kernel`. State
that is carried through the step but not trained (batch-norm running statistics) sits under the
top-level key `OTHER_KEY` ("batch_stats") of the params dict: the optimizer never sees it, so
`opt_state`'s Adam `mu`/`nu` mirror exactly the trainable part of `params`.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hlomap.run.grad import value_and_grad

logger = logging.getLogger(__name__)

#: Nested dict of arrays (or of `jax.ShapeDtypeStruct`s when abstract).
Params = dict[str, Any]
Batch = dict[str, Any]
#: (trainable params, other state, batch) -> (scalar loss, updated other state)
LossFn = Callable[[Params, Params, Batch], tuple[jax.Array, Params]]
#: (params, opt_state, batch) -> (params, opt_state, loss)
TrainStep = Callable[[Params, Any, Batch], tuple[Params, Any, jax.Array]]

#: Top-level params key of non-trained state (batch-norm running statistics).
OTHER_KEY = "batch_stats"

#: `example_args` refuses to allocate more than this by default: the big entries exist to be
#: lowered abstractly, and t5-11b's real arguments (about 135 GB) would take the machine down.
DEFAULT_MAX_EXAMPLE_BYTES = 4 * 2**30

#: XLA options for code that runs once (parameter initialisation): fastest compile.
_RUN_ONCE_OPTIONS: Mapping[str, Any] = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


class ZooError(KeyError):
    """An unknown zoo name, or a zoo request that cannot be met (too large to allocate...)."""

    def __str__(self) -> str:
        # KeyError's str() repr-quotes its argument; these messages are prose.
        return str(self.args[0]) if self.args else ""


#: Separates a zoo name from a compute dtype that overrides the entry's: `gpt-1.3b:float32`.
DTYPE_SEPARATOR = ":"

#: Dtypes a zoo transformer may compute in (its `compute_dtype`), by numpy name. Parameters and
#: optimizer state are float32 whatever this is. (No float16: it would need loss scaling, and
#: the attention mask's -1e9 is out of its range.)
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def check_compute_dtype(owner: str, compute_dtype: object) -> None:
    """ZooError naming `owner` (a config or zoo entry) when `compute_dtype` is not one of
    `COMPUTE_DTYPES`."""
    if not isinstance(compute_dtype, str) or compute_dtype not in COMPUTE_DTYPES:
        raise ZooError(f"{owner}: compute_dtype={compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")


class Family(str, enum.Enum):
    """Architecture family of a zoo entry (a str, so `entry.family == "gpt"` also holds)."""

    GPT = "gpt"
    BERT = "bert"
    T5 = "t5"
    VGG = "vgg"
    RESNET = "resnet"
    MOE = "moe"
    MLP = "mlp"

    def __str__(self) -> str:
        return self.value


class BatchField(NamedTuple):
    """One entry of a batch: its shape and dtype, and for integer fields the exclusive upper
    bound of valid values (vocabulary size, number of classes) so example data stays in range."""

    shape: tuple[int, ...]
    dtype: Any
    high: int | None = None

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, jnp.dtype(self.dtype))


class Architecture(Protocol):
    """What every family config provides. Configs are frozen dataclasses of sizes."""

    family: ClassVar[Family]
    learning_rate: float

    def init(self, key: jax.Array) -> Params:
        """All parameters (trainable + `OTHER_KEY` state) from a PRNG key; traceable, so it can
        run under `jax.eval_shape` (abstract) or `jax.jit` (real)."""
        ...

    def make_loss(self) -> LossFn:
        """A pure loss function closed over whatever static structure the family needs."""
        ...

    def batch_fields(self) -> dict[str, BatchField]:
        """Name -> shape/dtype/range of each batch entry."""
        ...


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def split_other(params: Params) -> tuple[Params, Params]:
    """(trainable, other) halves of a params dict; `other` is {} for families without state."""
    trainable = {k: v for k, v in params.items() if k != OTHER_KEY}
    return trainable, params.get(OTHER_KEY, {})


def join_other(trainable: Params, other: Params) -> Params:
    """Inverse of `split_other`; omits the `OTHER_KEY` entry when there is no other state."""
    return {**trainable, OTHER_KEY: other} if other else dict(trainable)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation) -> TrainStep:
    """Forward, backward and optimizer update as one pure function of (params, opt_state, batch).

    Only the trainable half of params is differentiated and updated; the other half (running
    statistics) is replaced by what the forward pass computed.
    """

    def train_step(params: Params, opt_state: Any, batch: Batch) -> tuple[Params, Any, jax.Array]:
        trainable, other = split_other(params)
        (loss, new_other), grads = value_and_grad(loss_fn, has_aux=True)(trainable, other, batch)
        updates, new_opt_state = optimizer.update(grads, opt_state, trainable)
        new_trainable = optax.apply_updates(trainable, updates)
        return join_other(new_trainable, new_other), new_opt_state, loss

    return train_step


def tree_paths(tree: Any) -> tuple[str, ...]:
    """'/'-joined dict-key paths of every leaf, in pytree (sorted-key) order."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return tuple("/".join(_key_name(k) for k in path) for path, _ in leaves)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tree_bytes(tree: Any) -> int:
    """Bytes the leaves of a (possibly abstract) pytree would occupy."""
    return sum(
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(tree)
    )


def example_batch(fields: Mapping[str, BatchField], key: jax.Array) -> Batch:
    """Random batch matching `fields`: uniform integers in [0, high), standard-normal floats."""
    keys = jax.random.split(key, len(fields))
    batch: Batch = {}
    for field_key, (name, field) in zip(keys, sorted(fields.items())):
        dtype = jnp.dtype(field.dtype)
        if jnp.issubdtype(dtype, jnp.integer):
            if field.high is None:
                raise ZooError(f"integer batch field {name!r} has no upper bound (high=None)")
            batch[name] = jax.random.randint(field_key, field.shape, 0, field.high, dtype=dtype)
        else:
            batch[name] = jax.random.normal(field_key, field.shape, dtype=dtype)
    return batch


# ---------------------------------------------------------------------------------------------
# ZooModel
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooModel:
    """A benchmark training step: `train_step()(params, opt_state, batch) -> (params, opt_state,
    loss)` with Adam, plus its arguments abstractly (`abstract_args`) or really (`example_args`)."""

    name: str
    family: Family
    description: str
    config: Architecture
    arg_names: tuple[str, ...] = ("params", "opt_state", "batch")
    #: trainable parameters as the registry declares them (what `zoo list` shows without
    #: tracing); `param_count()` computes them from the model
    parameters: int = 0

    @property
    def compute_dtype(self) -> str:
        """Dtype of the step's activations and dots ("float32" for families without the setting:
        the convolutional networks and the Haiku MLP)."""
        return str(getattr(self.config, "compute_dtype", "float32"))

    def with_compute_dtype(self, compute_dtype: str) -> "ZooModel":
        """This entry computing in `compute_dtype` (one of `COMPUTE_DTYPES`), named
        `NAME:DTYPE`; itself when that is already its dtype. ZooError for a bad dtype, or for a
        family that computes in float32 only."""
        check_compute_dtype(f"zoo model {self.name!r}", compute_dtype)
        if compute_dtype == self.compute_dtype:
            return self
        if not hasattr(self.config, "compute_dtype"):
            raise ZooError(f"zoo model {self.name!r} computes in float32 only; a compute dtype is a "
                           "setting of the transformer families (gpt, bert, t5, moe)")
        config = replace(self.config, compute_dtype=compute_dtype)  # type: ignore[type-var]
        base = self.name.partition(DTYPE_SEPARATOR)[0]  # a variant of a variant names the entry once
        return replace(self, name=f"{base}{DTYPE_SEPARATOR}{compute_dtype}", config=config)

    def optimizer(self) -> optax.GradientTransformation:
        return optax.adam(self.config.learning_rate)

    def train_step(self) -> TrainStep:
        return make_train_step(self.config.make_loss(), self.optimizer())

    def abstract_params(self) -> Params:
        """Params as `jax.ShapeDtypeStruct`s; traces the initialiser, allocates no weights."""
        return jax.eval_shape(lambda: self.config.init(jax.random.key(0)))

    def abstract_args(self) -> tuple[Params, Any, Batch]:
        """(params, opt_state, batch) as pytrees of `jax.ShapeDtypeStruct`; allocates nothing."""
        params = self.abstract_params()
        trainable, _ = split_other(params)
        opt_state = jax.eval_shape(self.optimizer().init, trainable)
        batch = {name: field.abstract() for name, field in self.config.batch_fields().items()}
        return params, opt_state, batch

    def example_args(
        self, seed: int = 0, *, max_bytes: int | None = DEFAULT_MAX_EXAMPLE_BYTES
    ) -> tuple[Params, Any, Batch]:
        """Real (params, opt_state, batch) of this entry's sizes, deterministic in `seed`.

        Raises ZooError when they would take more than `max_bytes` (None: no limit).
        """
        needed = tree_bytes(self.abstract_args())
        if max_bytes is not None and needed > max_bytes:
            raise ZooError(
                f"zoo entry {self.name!r} needs {needed / 2**30:.1f} GiB of real arguments, more "
                f"than max_bytes={max_bytes} ({max_bytes / 2**30:.1f} GiB); use abstract_args() "
                "or pass max_bytes=None"
            )
        logger.debug("zoo %s: allocating %.1f MiB of example arguments", self.name, needed / 2**20)
        params_key, batch_key = jax.random.split(jax.random.key(seed))
        # The initialiser runs once, so spend no compile time optimising it: XLA's default
        # pipeline takes several seconds on ResNet-50's ~160 random initialisers.
        init = jax.jit(self.config.init).lower(params_key).compile(compiler_options=_RUN_ONCE_OPTIONS)
        params = init(params_key)
        trainable, _ = split_other(params)
        opt_state = jax.jit(self.optimizer().init)(trainable)
        batch = example_batch(self.config.batch_fields(), batch_key)
        return params, opt_state, batch

    def lower(self) -> jax.stages.Lowered:
        """`jax.jit(train_step, keep_unused=True).lower(*abstract_args())`: as `hlomap.capture`
        lowers it, so that a dump of `hlo_text` is the module `zoo:NAME` and `hlomap zoo dump`
        give (XLA would drop an unused argument otherwise)."""
        lowered = jax.jit(self.train_step(), keep_unused=True).lower(*self.abstract_args())
        logger.debug("zoo %s: lowered the train step", self.name)
        return lowered

    def hlo_text(self) -> str:
        """HLO text of the lowered step, with metadata (op_name carries `transpose(jvp(` on
        backward instructions and `layers_i` scopes, which hlomap's capture relies on)."""
        return self.lower().as_text(dialect="hlo", debug_info=True)

    def param_count(self) -> int:
        """Number of trainable scalars (batch-norm running statistics excluded)."""
        trainable, _ = split_other(self.abstract_params())
        return int(sum(np.prod(leaf.shape, dtype=np.int64) for leaf in jax.tree_util.tree_leaves(trainable)))

    def other_paths(self) -> tuple[str, ...]:
        """Paths in params of carried, non-trained state (role "other"), e.g.
        `batch_stats/stem/bn/mean`; empty for families without such state."""
        _, other = split_other(self.abstract_params())
        return tuple(f"{OTHER_KEY}/{path}" for path in tree_paths(other))
