"""Test setup: 8 emulated CPU devices before JAX runs anything."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests pin their cost model: plans must not depend on this machine or on a calibration cached
# in the home directory. The expectations were built on the accelerator preset; tests of the
# default resolution clear these variables themselves.
os.environ["AUTOPAR_CLUSTER"] = "accelerator-8x"
os.environ["AUTOPAR_CACHE_DIR"] = "off"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_context():
    """Every test starts and ends with the default auto-parallel context and comm state, and
    with the once-per-process warnings not yet given (each test sees them as a fresh process
    would)."""
    import autopar
    from autopar.step_inputs import WARNED_ONCE

    autopar.reset_auto_parallel_context()
    autopar.hccl.reset_comm_groups()
    WARNED_ONCE.clear()
    yield
    autopar.reset_auto_parallel_context()
    autopar.hccl.reset_comm_groups()
