"""Shared by the gloo worlds: the one-process reference run every layout is compared with, and the worlds that
several modules' checks share.

Starting ranks (fork them, import the checks' modules, join the process group) costs more than many checks, so
modules whose checks need nothing prepared beforehand run them in one world per size. Checks are told apart by
module; the first failing check stops the world, and the later ones report "not run" naming it.
"""

from pathlib import Path

import pytest

from ._harness import WorldResult, run_world
from .layouts import curves, tiny


@pytest.fixture(scope="session")
def reference():
    ref = curves(tiny())
    assert ref["loss"][-1] < ref["loss"][0] - 0.5, "the reference loss should fall"
    return ref


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory) -> Path:
    """One directory per module whose checks write files: "moe", "context" (its documents written here), "pipeline"
    (a one-process checkpoint written here, for pp 2 to continue)."""
    from . import test_context_parallel, test_pipeline

    tmp = tmp_path_factory.mktemp("shared")
    test_context_parallel.prepare(tmp / "context")
    test_pipeline.prepare(tmp / "pipeline")
    return tmp


@pytest.fixture(scope="session")
def shared_world4(shared_tmp) -> WorldResult:
    """4 ranks: the dense parity layouts, the estimator's memory, the helpers, the MoE layouts."""
    from . import test_estimate, test_fp8, test_helpers, test_moe, test_parity_4

    moe = {"tmp": str(shared_tmp / "moe")}
    checks = [
        *test_parity_4.CHECKS,
        *test_fp8.CHECKS_4,
        *test_estimate.CHECKS,
        *test_helpers.CHECKS,
        *((c, moe) for c in test_moe.CHECKS_4),
    ]
    return run_world(4, checks, timeout_s=1600)


@pytest.fixture(scope="session")
def shared_world2(shared_tmp) -> WorldResult:
    """2 ranks: the dense parity layouts, transformers' Llama laid out by names, the MoE layouts, context
    parallelism, pipelines, then a compiled layout (its cold compile is the slowest check)."""
    from . import test_compile, test_context_parallel, test_fp8, test_hf_llama, test_moe, test_parity_2, test_pipeline

    moe, context, pipeline, fp8 = ({"tmp": str(shared_tmp / name)} for name in ("moe", "context", "pipeline", "fp8"))
    checks = [
        *test_parity_2.CHECKS,
        *test_hf_llama.CHECKS,
        *((c, fp8) for c in test_fp8.CHECKS_2),
        *((c, moe) for c in test_moe.CHECKS_2),
        *((c, context) for c in test_context_parallel.CHECKS_2),
        *((c, pipeline) for c in test_pipeline.CHECKS_2),
        *test_compile.CHECKS,
    ]
    return run_world(2, checks, timeout_s=1100)
