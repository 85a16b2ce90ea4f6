"""Limits that several layers check, each defined once.

>>> MAX_DEVICES
4096
"""

from __future__ import annotations

__all__ = ["MAX_DEVICES"]

#: The most devices a context, a mesh, a plan or a strategy file may name (MindSpore's).
MAX_DEVICES = 4096
