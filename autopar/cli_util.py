"""Helpers of the ``autopar`` command: option parsing (argparse types), device set-up, model
loading, the one-device reference run, one-line errors and the gloo log filter.

Kept apart from :mod:`autopar.cli` (the subcommands) so each stays one concept; the tables
and the progress bar the command prints are :mod:`autopar.text`'s.

>>> parse_options(["layers=2", "name=gpt"])
{'layers': 2, 'name': 'gpt'}
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from autopar.limits import MAX_DEVICES

__all__ = ["CLIError", "parse_options", "positive_int", "non_negative_float", "load_model",
           "setup_devices", "one_device_steps", "compare_with_reference", "drop_gloo_lines",
           "escape_breaks", "one_line"]


class CLIError(Exception):
    """Bad command-line input: printed as ``autopar: error: ...``, exit status 2."""


#: Characters that end a line (``str.splitlines`` splits on each), as Python escapes them
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in
                              "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def escape_breaks(text: str) -> str:
    r"""``text`` with every character that would end a line escaped as Python writes it, so a
    message quoting an argument that holds one stays the command's one error line.

    >>> escape_breaks("unrecognized arguments: a=b" + chr(10) + "c")
    'unrecognized arguments: a=b\\nc'
    """
    return text.translate(_LINE_BREAKS)


def one_line(e: BaseException) -> str:
    """An exception as one line for the command's error: its type and the first line of its
    message, at most 300 characters."""
    text = next((line for line in str(e).splitlines() if line.strip()), "")[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def parse_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``["layers=2", "hidden=64", "name=gpt"]`` -> ``{"layers": 2, "hidden": 64, ...}``;
    values are Python literals when they parse as one, strings otherwise."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"model option {item!r} must look like KEY=VALUE, e.g. layers=2")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        except (RecursionError, MemoryError):  # (-----...1: nested too deep to parse)
            raise CLIError(f"model option {key.strip()!r}: the value is too deeply nested to "
                           "read") from None
        if key.strip() in out:
            raise CLIError(f"model option {key.strip()!r} is given twice; give it once")
        out[key.strip()] = value
    return out


def positive_int(text: str) -> int:
    """An argparse type: an integer in ``[1, MAX_DEVICES]`` (devices, steps, rows).

    >>> positive_int("8")
    8
    """
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= n <= MAX_DEVICES:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_DEVICES}], got {n}")
    return n


def file_path(text: str, what: str = "file") -> Path:
    """An argparse type: a non-empty path (``Path("")`` would be ``.``, the directory).

    >>> file_path("plan.json").name
    'plan.json'
    """
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected a {what} path, got {text!r}")
    return Path(text)


def dir_path(text: str) -> Path:
    """:func:`file_path` for a directory (``--out DIR``).

    >>> dir_path("out").name
    'out'
    """
    return file_path(text, "directory")


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number ``>= 0`` (a tolerance)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (x >= 0 and x != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return x


def setup_devices(n: int) -> None:
    """Emulate ``n`` CPU devices; must run before the first JAX computation (the platform is
    the CPU whatever ``JAX_PLATFORMS`` the shell holds: a command's devices are emulated).
    When JAX is already running (``main()`` called from a program or a test), it must have
    ``n`` devices or more."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.device_count() < n:
            raise CLIError(f"JAX is already running with {jax.device_count()} devices; "
                           f"{n} are needed (run the autopar command in a fresh process)")
        return
    jax.config.update("jax_platforms", "cpu")  # (read from the environment at import)
    current = jax.config.jax_num_cpu_devices
    jax.config.update("jax_num_cpu_devices", max(n, current if current > 0 else 1))


def load_model(spec: str, options: dict[str, Any], *, concrete: bool = True
               ) -> tuple[Callable[..., Any], tuple[Any, ...], str]:
    """``(fn, example_args, description)`` for a zoo name or ``module:function``.

    A zoo name builds the model with ``options`` (its ``loss`` and example arguments; with
    ``concrete=False`` the arguments are ``jax.ShapeDtypeStruct`` s, nothing is allocated).
    ``module:function`` imports ``module`` (the current directory is on the path) and calls
    ``function(**options)``, which must return ``(fn, example_args)``.
    """
    import jax

    from autopar.errors import AutoparError
    from autopar.models import MODELS, get_model

    if ":" in spec:
        mod_name, _, fn_name = spec.partition(":")
        if not mod_name or not fn_name:
            raise CLIError(f"--model {spec!r}: expected MODULE:FUNCTION, e.g. mymodels:gpt")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(mod_name)
        except (Exception, SystemExit) as e:  # ImportError, or the module's own error / exit
            raise CLIError(f"--model {spec!r}: cannot import module {mod_name!r}: "
                           f"{one_line(e)}") from None
        builder = getattr(module, fn_name, None)
        if not callable(builder):
            raise CLIError(f"--model {spec!r}: module {mod_name!r} has no function {fn_name!r}")
        try:
            result = builder(**options)
        except (Exception, SystemExit) as e:  # the builder's own error (or exit): one line
            raise CLIError(f"--model {spec!r}: calling {fn_name}(**{options}) failed: "
                           f"{one_line(e)}") from None
        if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])):
            raise CLIError(f"--model {spec!r}: {fn_name}() must return (fn, example_args), "
                           f"got {type(result).__name__}")
        fn, args = result
        args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        return fn, args, f"{spec}({', '.join(f'{k}={v!r}' for k, v in options.items())})"
    if spec not in MODELS:
        raise CLIError(f"--model {spec!r}: not a zoo model ({', '.join(sorted(MODELS))}) "
                       "nor MODULE:FUNCTION")
    try:
        model = get_model(spec, **options)
    except AutoparError as e:
        raise CLIError(f"--model {spec}: {e}") from None
    # shapes only: nothing drawn, no device started (model.example_shapes)
    args = model.example_args(jax.random.key(0)) if concrete else model.example_shapes()
    desc = f"{spec}({', '.join(f'{k}={v!r}' for k, v in sorted(model.config.items()))})"
    return model.loss, tuple(args), desc


def one_device_steps(fn: Callable[..., Any], ex: tuple, steps: int, optimizer: Any
                     ) -> tuple[list[float], Any]:
    """``steps`` steps of ``optimizer`` on ``fn(params, *batch)`` on one device (the default
    device, no sharding), with ``ex = (params, *batch)``: ``(losses, final parameters)``, the
    reference of ``run --check`` and ``demo`` (pass the step's own ``.optimizer``)."""
    import jax
    import optax

    dev = jax.local_devices()[0]
    params = jax.device_put(ex[0], dev)
    batch = jax.device_put(tuple(ex[1:]), dev)
    state = optimizer.init(params)

    @jax.jit
    def one(p: Any, s: Any, b: Any) -> tuple:
        loss, g = jax.value_and_grad(fn)(p, *b)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    losses = []
    for _ in range(steps):
        params, state, loss = one(params, state, batch)
        losses.append(float(loss))
    return losses, jax.tree.map(lambda x: jax.device_get(x), params)


def compare_with_reference(losses: Sequence[float], params: Any,
                           ref_losses: Sequence[float], ref_params: Any, *,
                           atol: float | None = None) -> tuple[float, float, bool]:
    """The pass/fail rule of ``run --check`` and ``demo`` against one device:
    ``(max parameter difference, max loss difference, ok)``; ok when every parameter is within
    its tolerance and every step's loss within the loosest one times
    ``max(1, |reference loss|)``. The tolerance is ``atol``, or by default per parameter
    dtype :func:`default_tolerance` (1e-4 in float32; a few units of the last place of a
    16-bit float, whose every step rounds).

    >>> compare_with_reference([2.0, 1.0], [1.0], [2.0001, 1.5], [1.0])[2]
    False
    """
    import jax
    import numpy as np

    leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(ref_params)
    tols = [default_tolerance(np.asarray(a).dtype) if atol is None else atol for a in leaves]
    diff, ok = 0.0, len(leaves) == len(ref_leaves) and len(losses) == len(ref_losses)
    for a, b, tol in zip(leaves, ref_leaves, tols):
        d = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)),
                         initial=0.0))
        diff, ok = max(diff, d), ok and d <= tol
    loss_tol = max(tols, default=1e-4 if atol is None else atol)
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
    ok = ok and all(abs(a - b) <= loss_tol * max(1.0, abs(b))
                    for a, b in zip(losses, ref_losses))
    return diff, loss_diff, ok


def default_tolerance(dtype: Any) -> float:
    """``run --check``'s tolerance for a parameter of ``dtype``: 1e-4, or four machine
    epsilons of a coarser float (bfloat16: 0.03125, float16: 0.0039).

    >>> default_tolerance("float32"), default_tolerance("float16")
    (0.0001, 0.00390625)
    """
    import jax.numpy as jnp

    try:
        eps = float(jnp.finfo(dtype).eps)
    except ValueError:  # not a float: compared exactly as float32 would be
        return 1e-4
    return max(1e-4, 4 * eps)


#: The words of gloo's connection report (``[Gloo] Rank 0 is connected to 7 peer ranks.
#: Expected number of connected peer ranks is : 7``), which C++ threads write to fd 1 in
#: fragments that interleave mid-line (a line may be a lone ``1``).
_GLOO_WORDS = re.compile(rb"\[Gloo\]|Rank|is|connected|to|peer|ranks|Expected|number|of|[.:]|"
                         rb"\d+|\s+")


def is_gloo_noise(line: bytes) -> bool:
    """True for a line of native output made only of the words of gloo's connection
    reports, or of their fragments (numbers, blanks).

    >>> is_gloo_noise(b"[Gloo] Rank 0[Gloo] Rank 1 is connected to 3 peer ranks. Expected")
    True
    >>> is_gloo_noise(b"7 peer ranks. Expected number of connected peer ranks is : 7")
    True
    >>> is_gloo_noise(b"1"), is_gloo_noise(b"XLA says hi"), is_gloo_noise(b"[Gloo] says hi")
    (True, False, False)
    """
    return not _GLOO_WORDS.sub(b"", line)


def drop_gloo_lines() -> None:
    """Keep gloo's connection reports (one per communicator and rank, dozens per
    multi-process run, written by the C++ library straight to fd 1 from several threads)
    out of stdout. Python's own output goes to the real stdout directly (``sys.stdout`` is
    rebound to a copy of it), so fd 1 then carries native output only: it runs through a
    filter that drops the reports and their fragments (a lone ``1`` cannot be told from a
    table row otherwise) and passes every other line. Restored at exit."""
    sys.stdout.flush()
    real = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    old = sys.stdout
    sys.stdout = os.fdopen(os.dup(real), "w", buffering=1 if old.isatty() else -1,
                           encoding=old.encoding, errors=old.errors)

    def pump() -> None:
        with os.fdopen(read, "rb") as src, os.fdopen(os.dup(real), "wb") as dst:
            for line in src:
                if not is_gloo_noise(line):
                    dst.write(line)
                    dst.flush()

    thread = threading.Thread(target=pump, name="autopar-stdout-filter", daemon=True)
    thread.start()

    def restore() -> None:
        sys.stdout.flush()
        os.dup2(real, 1)  # closes the pipe's last writer: the pump drains and ends
        thread.join(timeout=5)
        sys.stdout.close()
        sys.stdout = old
        os.close(real)

    atexit.register(restore)
