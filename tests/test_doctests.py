"""Docs are tests, docstrings too: every ``>>>`` example in autopar's modules (the package,
its strategies and kernels) runs here, on the 8 emulated devices and the pinned cluster of
conftest.py, each module's examples in one namespace as ``python -m doctest`` runs them."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest


def _modules() -> list[str]:
    """Every module of autopar, its strategies and kernels (the two live in their own top
    folders, so they are walked from their own packages)."""
    names = set()
    for package in ("autopar", "autopar.strategies", "autopar.kernels"):
        path = importlib.import_module(package).__path__
        names.update(info.name for info in pkgutil.walk_packages(path, package + ".")
                     if not info.name.endswith("__main__"))
    return sorted(names)


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    return [t for t in tests if t.examples]


MODULES = [name for name in _modules() if _examples(name)]


def test_the_examples_are_found():
    assert {"autopar.split_advisor", "autopar.strategies.stages",
            "autopar.kernels.mm_reduce_scatter"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    reports: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in _examples(name):
        runner.run(test, out=reports.append)
    assert runner.failures == 0, "\n".join(reports)
