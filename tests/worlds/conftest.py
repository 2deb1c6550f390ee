"""Shared by the gloo worlds: the one-process reference run every layout is compared with."""

import pytest

from .layouts import curves, tiny


@pytest.fixture(scope="session")
def reference():
    ref = curves(tiny())
    assert ref["loss"][-1] < ref["loss"][0] - 0.5, "the reference loss should fall"
    return ref
