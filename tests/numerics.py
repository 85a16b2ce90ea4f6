"""Judge a parallel float32 result against a float64 run of the same function.

A sharded program sums partial products (and the backward pass sums cotangents) in another
order than one device, so it cannot equal the single-device float32 result bit for bit, and a
fixed ``rtol`` between the two is a tolerance tuned on one machine: on another CPU the
single-device reference itself lands elsewhere (zoo resnet50: the single-device float32 loss
was 2.4e-4 off the float64 one, relative, the parallel one 6.7e-6). Both float32 programs are
approximations of the same exact value, so each is judged by its distance to that value,
estimated by a float64 run of the same function on the same inputs:

    max |parallel - ref64|  <=  K * max |single32 - ref64|  +  C * eps32 * max |ref64|

per leaf of the result pytree (``eps32 = 2**-23``).

* ``K = 4``: a parallel program may round a few times worse than the one-device program (it
  adds partial sums in a tree of another shape, casts around collectives), but not by an order
  of magnitude: the factor is what the bound allows beyond the one-device rounding, which is
  measured on this machine, not guessed.
* ``C = 64``: the floor for leaves where the single-device float32 run happens to be (almost)
  exact, e.g. a loss that rounds to the float64 value: 64 float32 ulps of the leaf's largest
  magnitude (7.6e-6 relative), the rounding of a few chained reductions. It also covers the
  float64 reference's own float32 pieces (the zoo cross-entropy casts the logits to float32).

A layout bug, a missing or doubled all-reduce, a wrong gradient scale gives errors of the order
of the values themselves (1e-1 to 1, i.e. 1e4 x the floor), so the bound still catches them;
``tests/test_numerics.py`` checks that it rejects a 1e-3 relative perturbation. Where the
single-device run is itself poor (resnet50's 2.4e-4) the bound grows with it, to about 1e-3
relative there: still two orders of magnitude below a real bug.

"The same function" must compute the same thing in float64: one that draws random numbers in
its input's dtype draws other numbers in float64 (draw in float32 and cast instead).

Usage::

    ref = numerics.reference(m.loss, *args)        # float64 + single-device float32 runs
    numerics.check(parallel_f(*args), ref)         # AssertionError naming the bad leaves

Results are stored as NumPy arrays (cache ``Reference`` objects freely): nothing computed under
``jax.enable_x64`` escapes as a JAX array, and no global state is kept here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

K = 4
"""How many times the single-device float32 error a parallel result may be off the float64."""
C = 64
"""The floor, in float32 ulps (eps32) of each leaf's largest float64 magnitude."""
EPS32 = 2.0 ** -23


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jnp.floating)


def to_float64(tree: Any) -> Any:
    """Floating leaves as float64 NumPy arrays (a host cast: an eager device cast compiles one
    program per shape); integer, bool, PRNG-key and Python leaves as they are. Pass the result
    to JAX under ``jax.enable_x64(True)``: outside it, JAX would cast it back to float32."""
    return jax.tree.map(lambda x: np.asarray(x, np.float64) if _is_float(x) else x, tree)


def to_numpy(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options of the float64 run: cheap code generation (compiling costs more than running
at test sizes); float64 stays float64."""


def run64(fn: Callable[..., Any], *args: Any, jit: bool = True) -> Any:
    """``fn(*args)`` in float64 (floating inputs cast; ``jit`` it, compiled with :data:`FAST`,
    or call it as is, e.g. when it jits its own steps), returned as NumPy arrays."""
    with jax.enable_x64(True):
        args64 = to_float64(args)
        out = (jax.jit(fn, compiler_options=FAST) if jit else fn)(*args64)
        return to_numpy(out)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A function's result on the same inputs in float64 and on one device in float32."""

    f64: Any
    f32: Any


def reference(fn: Callable[..., Any], *args: Any, single: Any = None,
              jit: bool = True) -> Reference:
    """Run ``fn(*args)`` in float64 and (unless ``single`` gives it) on one device in float32.

    ``jit=False`` calls ``fn`` as it is in both precisions (for a function that jits its own
    steps, or to compare with an eagerly computed ``single``)."""
    if single is None:
        single = (jax.jit(fn) if jit else fn)(*args)
    return Reference(f64=run64(fn, *args, jit=jit), f32=to_numpy(single))


def leaf_report(got: Any, ref: Reference) -> list[tuple[str, float, float, float, bool]]:
    """``(leaf path, parallel error, single-device float32 error, bound, ok)`` per leaf."""
    flat64, tree64 = jax.tree_util.tree_flatten_with_path(ref.f64)
    got_leaves, got_tree = jax.tree.flatten(got)
    f32_leaves, f32_tree = jax.tree.flatten(ref.f32)
    if got_tree != tree64 or f32_tree != tree64:
        raise AssertionError(f"result structures differ: parallel {got_tree}, single-device "
                             f"{f32_tree}, float64 {tree64}")
    rows = []
    for (path, r), g, s in zip(flat64, got_leaves, f32_leaves):
        name = jax.tree_util.keystr(path) or "<result>"
        r, g, s = np.asarray(r), np.asarray(jax.device_get(g)), np.asarray(s)
        if g.shape != r.shape or s.shape != r.shape:
            raise AssertionError(f"{name}: shapes differ: parallel {g.shape}, single-device "
                                 f"{s.shape}, float64 {r.shape}")
        if not _is_float(r):
            same = bool(np.array_equal(g, r)) and bool(np.array_equal(s, r))
            rows.append((name, 0.0 if same else np.inf, 0.0, 0.0, same))
            continue
        r = r.astype(np.float64)
        err = float(np.max(np.abs(g.astype(np.float64) - r))) if r.size else 0.0
        err32 = float(np.max(np.abs(s.astype(np.float64) - r))) if r.size else 0.0
        floor = C * EPS32 * (float(np.max(np.abs(r))) if r.size else 0.0)
        bound = K * err32 + floor
        rows.append((name, err, err32, bound, bool(err <= bound)))  # NaN -> not ok
    return rows


def check(got: Any, ref: Reference, what: str = "parallel result") -> None:
    """Assert every leaf of ``got`` is within the bound of the module docstring."""
    bad = [row for row in leaf_report(got, ref) if not row[-1]]
    if bad:
        lines = [f"  {name}: |{what} - float64| = {err:.3g} > bound {bound:.3g} "
                 f"(single-device float32 error {err32:.3g})" for name, err, err32, bound, _ in bad]
        raise AssertionError(
            f"{what} is further from the float64 reference than {K} x the single-device "
            f"float32 error + {C} float32 ulps of the leaf's max, in {len(bad)} leaves:\n"
            + "\n".join(lines))


def assert_close(got: Any, fn: Callable[..., Any], *args: Any, single: Any = None,
                 jit: bool = True, what: str = "parallel result") -> Reference:
    """:func:`reference` then :func:`check`; returns the reference (to reuse it)."""
    ref = reference(fn, *args, single=single, jit=jit)
    check(got, ref, what)
    return ref


def optimizer_steps(loss: Callable[..., Any], opt: optax.GradientTransformation | None = None,
                    steps: int = 1, loss_scale: float = 1.0) -> Callable[..., Any]:
    """``(params, *batch) -> (params after `steps` optimizer updates, [loss per step])`` on one
    device: the training step to reference (call with ``jit=False``; each update is jitted).

    ``loss_scale`` multiplies the gradients (not the reported loss): a step that sums, not
    averages, ``dp`` data-parallel gradients (``gradients_mean=False``) is ``loss_scale=dp``."""
    from autopar.train import DEFAULT_LEARNING_RATE

    opt = opt or optax.sgd(DEFAULT_LEARNING_RATE)

    def one(p: Any, s: Any, *batch: Any) -> tuple[Any, Any, Any]:
        value, g = jax.value_and_grad(loss)(p, *batch)
        if loss_scale != 1.0:
            g = jax.tree.map(lambda a: a * loss_scale, g)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    one32, one64 = jax.jit(one), jax.jit(one, compiler_options=FAST)

    def run(params: Any, *batch: Any) -> tuple[Any, list[Any]]:
        one = one64 if jax.config.jax_enable_x64 else one32
        state = opt.init(params)
        losses = []
        for _ in range(steps):
            params, state, value = one(params, state, *batch)
            losses.append(value)
        return params, losses

    return run
