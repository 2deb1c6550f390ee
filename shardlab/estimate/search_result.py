"""What a search returns: the layouts it estimated (`Candidate`, with where each one's step goes) and the ranking with
what it took (`Search`); `shardlab.estimate.search` finds them, `shardlab.estimate.search_report` prints them."""

from __future__ import annotations

import math

from shardlab._base import Frozen
from shardlab.config import Config
from shardlab.estimate import Estimate
from shardlab.estimate.device import Device
from shardlab.estimate.layouts import Layout
from shardlab.estimate.roofline import DP_AXES, StepTime, collective_seconds


class Candidate(Frozen):
    """One estimated layout."""

    layout: Layout
    peak: int
    """Bytes on the worst rank at its peak (`Estimate.peak`)."""
    step_s: float
    tokens_per_s_per_device: float
    mfu: float
    comm_s: tuple[tuple[str, float], ...]
    """Seconds per step of communication on each mesh axis (overlapped or not), largest first."""
    parts: tuple[tuple[str, float], ...]
    """Where the step goes, in seconds that add up to step_s (`_parts`): compute, recomputation, pp sends, bubble,
    optimizer, each mesh axis's exposed communication."""


class Search(Frozen):
    """The ranking and what it took."""

    best: tuple[Candidate, ...]
    """Layouts that fit, fastest first (at most `top`)."""
    layouts: int
    """Valid layouts enumerated."""
    over_memory: int
    """Dropped before any probe: what their plan fixes (parameters, gradients, optimizer state, FSDP's buffers) and
    the activations they keep at least (`Floors.activations`) exceed the memory."""
    too_big: int
    """Dropped without a probe of their own: a sibling needing no more memory did not fit (the same layout resharding
    FSDP's weights after forward, checkpointing more, or with fewer rows per micro batch)."""
    estimated: int
    bounded: int
    """Estimated without the probe of the pp rank holding their pipeline's last stage (they did not fit, or could not
    enter the top K even at the lower bound on their step time that leaves it out)."""
    pruned: int
    """Not looked at: their floor (`shardlab.estimate.floors`; for a pipeline, with each block doing what one of an
    estimated layout of the same local shapes does) is above the `top`-th fastest layout that fits."""
    unsearched: int
    """Not looked at because the budget ran out (0: the ranking is the exhaustive search's)."""
    floor_left: float | None
    """The lowest floor among the `unsearched` layouts (seconds per step; None where none): none is faster."""
    probes: int
    stored: int
    """Probes read from the store (`ProbeStore`: an earlier search's), not run."""
    seconds: float

    @property
    def pick_within(self) -> float:
        """How many times slower than the fastest layout the pick may be: 1.0 where the search was exhaustive or
        the pick is faster than every floor it left; inf where the layouts left have no floor (a model whose
        blocks could not be counted, `shardlab.estimate.floors`)."""
        if self.floor_left is None:
            return 1.0
        return max(1.0, self.best[0].step_s / self.floor_left) if self.floor_left > 0 else math.inf


def as_candidate(layout: Layout, e: Estimate, cfg: Config, dev: Device) -> Candidate:
    t = e.time
    comm: dict[str, float] = {}
    for c in e.collectives:
        comm[c.axis] = comm.get(c.axis, 0.0) + collective_seconds(c, cfg.mesh, dev)
    comm_s = tuple(sorted(comm.items(), key=lambda kv: -kv[1]))
    return Candidate(
        layout=layout, peak=e.peak, step_s=t.step_s, tokens_per_s_per_device=t.tokens_per_s_per_device, mfu=t.mfu,
        comm_s=comm_s, parts=_parts(t, comm_s),
    )  # fmt: skip


def _parts(t: StepTime, comm_s: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    """The step's terms as the roofline adds them up (`roofline.step_time`): compute less its recomputation, the
    recomputation, pp sends, bubble, optimizer, then each axis's exposed communication (last: another layout's axes
    then line up with these). FSDP's collectives (every dp axis together) hide behind the compute; what they leave
    exposed is split between the dp axes by their seconds. TP's, CP's and EP's are exposed whole; the collectives a
    recomputation runs again stay their axis's."""
    exposed_fsdp = max(t.compute_s, t.fsdp_comm_s) - t.compute_s
    exposed = {
        f"exposed {axis} comm": exposed_fsdp * seconds / t.fsdp_comm_s if axis in DP_AXES else seconds
        for axis, seconds in comm_s
        if axis != "pp" and seconds > 0
    }
    return (
        ("compute", t.compute_s - t.recompute_s), ("recomputation", t.recompute_s), ("pp sends", t.pp_comm_s),
        ("bubble", t.bubble_s), ("optimizer", t.optimizer_s), *exposed.items(),
    )  # fmt: skip


def readable_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
