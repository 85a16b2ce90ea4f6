"""Unsupported primitives: one error naming every one of the traced function, each at the
user's line (not the library's that emitted it), with its count and how to proceed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autopar as ap
from autopar.cli import main
from autopar.graph import unsupported
from autopar.graph.ops import KINDS

HERE = Path(__file__).name


def _line(marker: str) -> int:
    """The line of this file that ends with ``marker``."""
    lines = Path(__file__).read_text().splitlines()
    return next(k for k, text in enumerate(lines, 1) if text.rstrip().endswith(marker))


def _halving(c):  # a loop whose trip count depends on the data: no static unrolling
    return lax.while_loop(lambda v: v.sum() > 1.0, lambda v: v / 2, c)  # W


def _host(c):
    return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(c.shape, c.dtype), c)  # H


class Halve(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        return nn.while_loop(lambda m, c: c.sum() > 1.0, lambda m, c: c / 2, self, x).sum()  # A


def test_a_library_primitive_is_named_at_the_users_line_and_the_library_line():
    assert "while" not in KINDS
    model, x = Halve(), jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    with pytest.raises(ap.UnsupportedOperatorError) as info:
        ap.trace(model.apply, params, x)
    msg = str(info.value)
    assert f"'while' at {Path(__file__)}:{_line('# A')} (Halve.__call__)" in msg, msg
    assert ", emitted in flax/core/lift.py:" in msg and "site-packages" not in msg
    assert "How to proceed: use a Python loop" in msg and "\n" not in msg
    assert isinstance(info.value, ValueError) and info.value.summary == msg
    (found,) = info.value.unsupported
    assert (found.primitive, found.count) == ("while", 1)
    assert found.emitted.startswith("flax/") and f"{HERE}:" in found.where


def test_every_unsupported_primitive_is_listed_once_with_its_count_first_met_first():
    def f(x):
        y = _halving(x)
        y = jax.checkpoint(_halving)(y)
        z = jax.jit(lambda v: jnp.linalg.eigh(v)[0])(y @ y.T)  # D
        w = lax.while_loop(lambda v: _host(v).sum() > 1.0, lambda v: v / 2, x)
        return z.sum() + w.sum()

    assert not {"while", "eigh", "pure_callback"} & set(KINDS)
    with pytest.raises(ap.UnsupportedOperatorError) as info:
        ap.trace(f, jnp.ones((3, 3)))
    err = info.value
    lines = str(err).splitlines()
    assert lines[0] == ("3 JAX primitives (5 equations) are not supported by autopar's tracer. "
                        "How to proceed with each:")
    # first met first; the loop inside jax.checkpoint and the callback inside a loop's
    # condition counted too; eigh (made inside jnp's own jit) at the user's line
    assert [u.primitive for u in err.unsupported] == ["while", "eigh", "pure_callback"]
    assert [u.count for u in err.unsupported] == [3, 1, 1]
    # (the innermost of the user's frames: the user's helper that called lax)
    assert lines[1].startswith(f"  'while' x3 at {Path(__file__)}:{_line('# W')} (_halving): ")
    assert "emitted in" not in lines[1] and "use a Python loop" in lines[1]
    assert lines[2].startswith(f"  'eigh' at {Path(__file__)}:{_line('# D')} (")
    assert lines[3].startswith(f"  'pure_callback' at {Path(__file__)}:{_line('# H')} (_host)")
    assert all(unsupported.DEFAULT_HINT in x for x in lines[2:]) and len(lines) == 4
    assert "\n" not in err.summary and "'while' x3 at" in err.summary
    assert "'pure_callback' at" in err.summary


def test_a_long_list_is_cut_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(unsupported, "SHOWN", 1)
    monkeypatch.setattr(unsupported, "SUMMARIZED", 1)

    def f(x):
        return _host(_halving(x)).sum() + jnp.linalg.eigh(x)[0].sum() + _halving(x).sum()

    with pytest.raises(ap.UnsupportedOperatorError) as info:
        ap.trace(f, jnp.ones((3, 3)))
    lines = str(info.value).splitlines()
    assert len(lines) == 3 and lines[1].startswith("  'while' x2 at")
    assert lines[2] == "  ... and 2 more: 'pure_callback', 'eigh'."
    assert info.value.summary.endswith("; and 2 more (autopar.trace lists each).")


def test_the_rule_of_library_files():
    site = "/venv/lib/python3.11/site-packages/keras/src/ops/numpy.py"
    assert unsupported.installed(site) and unsupported.installed(site.replace("site", "dist"))
    assert unsupported.library_path(site) == "keras/src/ops/numpy.py"
    assert not unsupported.installed(__file__)
    assert unsupported.library_path(__file__) == __file__
    assert unsupported.library_path(unsupported.__file__) == "autopar/graph/unsupported.py"


def test_the_command_line_prints_the_list_on_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "loops.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax

        def model():
            def loss(p, x):
                h = lax.while_loop(lambda v: v.sum() > 1.0, lambda v: v / 2, x @ p)
                s = jax.ShapeDtypeStruct(h.shape, h.dtype)
                return jax.pure_callback(np.asarray, s, h).sum()
            return loss, (jnp.ones((8, 8)), jnp.ones((8, 8)))
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["search", "--model", "loops:model", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "2 JAX primitives (2 equations)" in lines[0] and "loops.py:7 (model.<locals>.loss)" \
        in lines[0] and "'pure_callback' at" in lines[0] and "loops.py:9" in lines[0]
    assert err.count("How to proceed") == 0 and "use a Python loop" in lines[0]
