"""MindSpore's algorithm parameters of the strategy search: set / get / reset, scoped, per thread.

``set_algo_parameters(**kwargs)`` takes the keys of ``mindspore.set_algo_parameters`` with
MindSpore's defaults, types and ranges. They live next to the auto-parallel context with the
same semantics: one frozen :class:`AlgoParameters` in a ``contextvars.ContextVar`` (each
thread has its own, a new thread starts from the defaults), a call validates every key and
applies all or none, and ``with algo_parameters_context(**kw):`` overrides keys for a block.
They are read once, by the search's entry point (:func:`autopar.search`), never below it.

What each does in autopar (:data:`EFFECTS`; docs/context.md has the table):

- ``fully_use_devices`` (default True): the default of ``autopar.search(fully_use_devices=)``:
  an operator's splits use every device (small operators may still repeat their work); False
  lets every operator leave devices repeating its work (a larger space).
- ``elementwise_op_strategy_follow`` (default False): elementwise operators take the strategy
  of the operator producing their input (``SearchSettings.elementwise_op_strategy_follow``).
- ``tensor_slice_align_enable`` / ``tensor_slice_align_size``, ``enable_algo_approxi`` /
  ``algo_approxi_epsilon``: validated and kept; setting them to a non-default value warns
  :class:`~autopar.errors.AutoParallelWarning` with the reason they change nothing here.

>>> set_algo_parameters(elementwise_op_strategy_follow=True)
>>> get_algo_parameters("elementwise_op_strategy_follow")
True
>>> with algo_parameters_context(fully_use_devices=False):
...     get_algo_parameters("fully_use_devices")
False
>>> get_algo_parameters("fully_use_devices")
True
>>> reset_algo_parameters()
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from typing import Annotated, Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from autopar.config import raise_for_validation_error, unknown_key_error
from autopar.errors import AutoParallelTypeError, AutoParallelWarning
from autopar.strategies.baselines import HAND_PLAN_MARGIN

__all__ = ["AlgoParameters", "ALGO_KEYS", "EFFECTS", "NO_EFFECT", "set_algo_parameters",
           "get_algo_parameters", "reset_algo_parameters", "algo_parameters_context",
           "current_algo_parameters", "algo_reference_rows"]

_WHERE = "set_algo_parameters"


class AlgoParameters(BaseModel):
    """The algorithm parameters with MindSpore's defaults (frozen; strict types)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    fully_use_devices: bool = Field(
        default=True, description="Only strategies that use every device (e.g. with 8 devices "
        "ReLU's (4, 1) is not a candidate).")
    elementwise_op_strategy_follow: bool = Field(
        default=False, description="Elementwise operators (Add, ReLU, ...) keep the strategy of "
        "the operator they follow.")
    tensor_slice_align_enable: bool = Field(
        default=False, description="Check that MatMul slices' last dimension is a multiple of "
        "tensor_slice_align_size.")
    tensor_slice_align_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=16, description="The MatMul slice alignment, in [1, 1024].")
    enable_algo_approxi: bool = Field(
        default=False, description="Approximate the search: keep at most 1/algo_approxi_epsilon "
        "candidate strategies per operator.")
    algo_approxi_epsilon: float = Field(
        default=0.1, description="The approximation's epsilon, in (0, 1].")
    hand_plan_margin: float = Field(
        default=HAND_PLAN_MARGIN, description="autopar's own: under auto_parallel the "
        "search's plan is kept over the cheapest hand plan (data parallel, Megatron's layout) "
        "only when priced cheaper by more than this fraction, in [0, 1).")

    @field_validator("algo_approxi_epsilon", mode="plain")
    @classmethod
    def _epsilon(cls, v: Any) -> float:
        if not isinstance(v, float):  # MindSpore's args_type_check: a float, not an int
            raise PydanticCustomError("autopar_type", "must be a float in (0, 1] (write 1.0, "
                                      "not 1)")
        if not math.isfinite(v) or not 0.0 < v <= 1.0:
            raise ValueError("must be a float in (0, 1]")
        return v

    @field_validator("hand_plan_margin", mode="plain")
    @classmethod
    def _margin(cls, v: Any) -> float:
        if not isinstance(v, float):
            raise PydanticCustomError("autopar_type", "must be a float in [0, 1) (write 0.0, "
                                      "not 0)")
        if not math.isfinite(v) or not 0.0 <= v < 1.0:
            raise ValueError("must be a float in [0, 1)")
        return v


ALGO_KEYS: tuple[str, ...] = tuple(AlgoParameters.model_fields)
_DEFAULTS = AlgoParameters()

#: Why the parameters autopar accepts but cannot honour change nothing (setting one to a
#: non-default value warns this reason).
NO_EFFECT: dict[str, str] = {
    "tensor_slice_align_enable": "autopar prices every MatMul slice with the cluster's "
    "measured compute fits instead of filtering slice shapes, so no strategy is dropped for "
    "its alignment",
    "tensor_slice_align_size": "it only sizes tensor_slice_align_enable's filter, which "
    "autopar does not apply",
    "enable_algo_approxi": "autopar's solvers search every candidate strategy (the "
    "dynamic_programming eliminations and its exact core are not pruned)",
    "algo_approxi_epsilon": "it only sizes enable_algo_approxi's pruning, which autopar does "
    "not apply",
}
#: What each parameter does in autopar (docs/context.md's table).
EFFECTS: dict[str, str] = {
    "fully_use_devices": "the default of autopar.search(fully_use_devices=...): True keeps "
    "every operator's splits on every device (operators with at most 4 MiB of output may "
    "repeat work); False lets every operator repeat work on some mesh axes (a larger space)",
    "hand_plan_margin": "auto_parallel on several devices: the search returns the cheapest "
    "hand plan unless its own plan is priced cheaper than it by more than this fraction "
    "(SearchSettings.hand_plan_margin; 0.0: the cheapest plan, whichever it is)",
    "elementwise_op_strategy_follow": "auto_parallel: every elementwise operator takes the "
    "split counts of the value it reads (its producer's output or a data input); the other "
    "operators are searched again around them (SearchSettings.elementwise_op_strategy_follow)",
    **{k: f"no effect: {r}" for k, r in NO_EFFECT.items()},
}

_STATE: contextvars.ContextVar[AlgoParameters] = contextvars.ContextVar("autopar_algo",
                                                                        default=_DEFAULTS)


def _apply(current: AlgoParameters, kwargs: dict[str, Any], where: str) -> AlgoParameters:
    """Pure: the parameters after setting kwargs (all validated first), or an error."""
    for key in kwargs:
        if not isinstance(key, str):
            raise AutoParallelTypeError(f"{where}: key {key!r} must be a str.")
        if key not in ALGO_KEYS:
            raise unknown_key_error(key, ALGO_KEYS, where)
    try:
        new = AlgoParameters.model_validate({**current.model_dump(), **kwargs})
    except ValidationError as err:
        raise_for_validation_error(err, where)
        raise  # unreachable
    for key in ALGO_KEYS:
        if key in kwargs and key in NO_EFFECT and getattr(new, key) != getattr(_DEFAULTS, key):
            warnings.warn(f"{key}={getattr(new, key)!r} has no effect in autopar: "
                          f"{NO_EFFECT[key]}.", AutoParallelWarning, stacklevel=3)
    return new


def set_algo_parameters(**kwargs: Any) -> None:
    """Set algorithm parameters (MindSpore's keys); every key is validated before any is set.

    Raises UnknownKeyError (a ValueError) for an unknown key, AutoParallelTypeError (a
    TypeError) for a wrong type, AutoParallelError (a ValueError) out of range.
    """
    _STATE.set(_apply(_STATE.get(), kwargs, _WHERE))


def get_algo_parameters(attr_key: str) -> Any:
    """The value of one algorithm parameter."""
    if not isinstance(attr_key, str):
        raise AutoParallelTypeError("attr_key", attr_key, "an algorithm parameter name (str)")
    if attr_key not in ALGO_KEYS:
        raise unknown_key_error(attr_key, ALGO_KEYS, "get_algo_parameters")
    return getattr(_STATE.get(), attr_key)


def reset_algo_parameters() -> None:
    """Every algorithm parameter back to its default (in this thread / context)."""
    _STATE.set(_DEFAULTS)


@contextlib.contextmanager
def algo_parameters_context(**kwargs: Any) -> Iterator[AlgoParameters]:
    """Override algorithm parameters for a block; the previous ones come back afterwards."""
    token = _STATE.set(_apply(_STATE.get(), kwargs, "algo_parameters_context"))
    try:
        yield _STATE.get()
    finally:
        _STATE.reset(token)


def current_algo_parameters() -> AlgoParameters:
    """The current (frozen) algorithm parameters: read once by the search's entry point."""
    return _STATE.get()


def algo_reference_rows() -> list[dict[str, str]]:
    """One row per parameter for docs/context.md: key, type, default, range, effect."""
    ranges = {"tensor_slice_align_size": "[1, 1024]", "algo_approxi_epsilon": "(0, 1]",
              "hand_plan_margin": "[0, 1)"}
    rows = []
    for name, field in AlgoParameters.model_fields.items():
        ann = field.annotation
        rows.append({"key": name, "type": getattr(ann, "__name__", "int"),
                     "default": repr(getattr(_DEFAULTS, name)),
                     "range": ranges.get(name, "-"), "description": field.description or "",
                     "effect": EFFECTS[name]})
    return rows
