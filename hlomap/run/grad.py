"""`value_and_grad`: `jax.value_and_grad` that marks where a train step's loss and gradient are.

A pipeline runner has to find, inside an ordinary train step, the function whose gradient is
taken (to cut it into stages) and the code around it (the optimizer update, metrics, which then
runs per stage). Alpa marks that call with `alpa.grad` (Zheng et al., OSDI'22, section 6); this is
the same idea as a drop-in: outside a pipeline runner it *is* `jax.value_and_grad` (same arguments,
same jaxpr, same HLO), and while a runner traces the step (`intercept`) the call is handed to the
runner instead.

This module is deliberately light (it imports only JAX) so that model code, such as the zoo's
`make_train_step`, can use it without importing the runner.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
from jax.extend import source_info_util

__all__ = ["GradCall", "intercept", "value_and_grad"]

# The wrapper below adds a Python frame between the user's code and `jax.value_and_grad`; JAX
# would attribute the ops it creates (the cotangent seed) to this file in HLO metadata. Excluding
# it keeps the HLO of a marked step identical to the unmarked one, metadata included.
source_info_util.register_exclusion(__file__)


class GradCall(NamedTuple):
    """One call of a marked function: what to differentiate and with which arguments."""

    fun: Callable[..., Any]
    argnums: int | tuple[int, ...]
    has_aux: bool
    options: tuple[tuple[str, Any], ...]  # holomorphic, allow_int, reduce_axes as given
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    def plain(self) -> Any:
        """What `jax.value_and_grad` returns for this call."""
        grad = jax.value_and_grad(self.fun, argnums=self.argnums, has_aux=self.has_aux, **dict(self.options))
        return grad(*self.args, **dict(self.kwargs))


#: The runner tracing a step right now, if any: it receives every marked call instead of JAX.
_HANDLER: contextvars.ContextVar[Callable[[GradCall], Any] | None] = contextvars.ContextVar(
    "hlomap_value_and_grad_handler", default=None)


@contextlib.contextmanager
def intercept(handler: Callable[[GradCall], Any]) -> Iterator[None]:
    """While active, every call of a `value_and_grad`-marked function goes to `handler`, which
    returns what the call returns (the runner's pipelined loss, aux and gradients)."""
    token = _HANDLER.set(handler)
    try:
        yield
    finally:
        _HANDLER.reset(token)


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   **options: Any) -> Callable[..., Any]:
    """`jax.value_and_grad(fun, argnums, has_aux, ...)`, marked for `hlomap.parallelize`.

    Replace `jax.value_and_grad` by this in a train step and a pipeline plan can run it: the
    runner cuts `fun` into stages and runs the rest of the step per stage. Anywhere else it
    behaves exactly like `jax.value_and_grad`.
    """
    argnums = argnums if isinstance(argnums, int) else tuple(argnums)
    plain = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **options)

    @functools.wraps(fun)
    def marked(*args: Any, **kwargs: Any) -> Any:
        handler = _HANDLER.get()
        if handler is None:
            return plain(*args, **kwargs)
        return handler(GradCall(fun, argnums, has_aux, tuple(sorted(options.items())), args,
                                tuple(sorted(kwargs.items()))))

    marked.__wrapped_value_and_grad__ = fun  # type: ignore[attr-defined]
    return marked
