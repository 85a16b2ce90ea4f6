"""The autopar model zoo: plain-JAX models that exercise the tracer front end.

Every builder validates its arguments and returns a :class:`Model` (``init``, ``apply``,
``loss``, ``example_batch``, ``config``). ``MODELS`` maps registry names to builders and
:func:`get_model` builds one by name.

>>> import jax
>>> m = get_model("mlp", widths=(8, 16, 8), batch=4)
>>> params, x = m.example_args(jax.random.key(0))
>>> g = jax.grad(m.loss)(params, x)
>>> sorted(g["layer0"])
['b', 'w']
>>> get_model(m.name, **m.config).config == m.config
True
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from autopar.errors import AutoParallelError, AutoParallelTypeError, UnknownKeyError
from autopar.models.base import Model, Params, PyTree
from autopar.models.mlp import mlp
from autopar.models.resnet import resnet50
from autopar.models.transformer import tfm_stack, transformer

__all__ = ["Model", "Params", "PyTree", "MODELS", "get_model", "mlp", "transformer",
           "tfm_stack", "resnet50"]

MODELS: dict[str, Callable[..., Model]] = {
    "mlp": mlp,
    "transformer": transformer,
    "tfm_stack": tfm_stack,
    "resnet50": resnet50,
}
"""Registry name -> builder."""


def get_model(name: str, **kwargs: Any) -> Model:
    """Build the zoo model ``name`` with builder keyword arguments ``kwargs``.

    Raises:
        AutoParallelTypeError: ``name`` is not a str.
        AutoParallelError: ``name`` is not in :data:`MODELS` (the message lists the valid
            names); :class:`~autopar.errors.UnknownKeyError` for a keyword the builder does
            not take; the builder's own errors for bad values.

    >>> get_model("tfm_stack", blocks=2, batch=1, seq=4, hidden=8, heads=2).config["blocks"]
    2
    >>> get_model("vgg")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autopar.errors.AutoParallelError: model='vgg' is invalid: must be one of [...]. ...
    """
    valid = sorted(MODELS)
    if not isinstance(name, str):
        raise AutoParallelTypeError("model", name, f"must be a str, one of {valid}")
    if name not in MODELS:
        raise AutoParallelError("model", name, f"must be one of {valid}",
                                "Use a name from autopar.models.MODELS")
    builder = MODELS[name]
    accepted = list(inspect.signature(builder).parameters)
    for key in sorted(kwargs):
        if key not in accepted:
            raise UnknownKeyError(key, kwargs[key], f"not an argument of {name}(); "
                                  f"valid arguments are {accepted}")
    return builder(**kwargs)
