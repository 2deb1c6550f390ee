"""What a probe measures (`Run`, `Measurement`) and how one probe serves many layouts: any number of blocks
(`Measurement.at`), rows per micro batch (`Measurement.at_rows`), HSDP's replicas (`Measurement.replicated`), and a
pp rank put together from stages probed elsewhere (`staged`). `shardlab.estimate.probe` runs the fake step that
records them."""

from __future__ import annotations

import functools
from collections import Counter
from typing import NamedTuple

from shardlab._base import Frozen
from shardlab.estimate.recorder import Collective, OpKind, Recorder, Role


class Probe(Frozen):
    """One micro batch of forward + backward on the probed rank, for the whole model (with pipelines: for the
    probed pp rank's stages)."""

    collectives: tuple[Collective, ...]
    flops: int
    """Executed FLOPs: matmuls and attention (causal attention as run, half the square), recomputation included."""
    ops: tuple[tuple[int, int, int, OpKind], ...]
    """(FLOPs, bytes read + written, how many such ops, kind): the roofline's input, one entry per distinct op."""
    activation_bytes: int
    """Bytes the forward leaves alive for the backward (saved tensors, checkpoint inputs, logits, loss)."""
    block_activation_bytes: int
    """What one more block adds to activation_bytes (a model of at most 3 periods: the mean over its blocks)."""
    gather_ops: tuple[tuple[int, int, int, OpKind], ...] = ()
    """The part of `ops` FSDP ran to gather weights in the forward (copying shards in, gathered weights out)."""
    reduce_ops: tuple[tuple[int, int, int, OpKind], ...] = ()
    """The part of `ops` FSDP ran to reduce gradients (copying them into the reduce-scatter's buffer)."""
    recompute_ops: tuple[tuple[int, int, int, OpKind], ...] = ()
    """The part of `ops` that recomputed checkpointed activations in the backward (activation checkpointing's cost)."""


SHARD_AXES = ("dp_shard", "dp_shard_cp", "dp_shard_mod_ep")
"""The groups FSDP shards weights over: the model's (dp_shard, or with cp its flattened view) and the experts' (the
expert mesh's dp_shard_mod_ep)."""
CollectiveKey = tuple[str, str, str, int, int | None]
"""(axis, kind, phase, group size, stage): how a Recorder counts collectives."""


class Run(NamedTuple):
    """What one fake run recorded, as `Measurement` extends it."""

    collectives: dict[CollectiveKey, int]
    collective_bytes: dict[CollectiveKey, int]
    regathers: dict[CollectiveKey, int]
    """The collectives FSDP ran to gather weights again in the backward (none with reshard_after_forward=False)."""
    regather_bytes: dict[CollectiveKey, int]
    sequence: tuple[tuple[int, int, OpKind, Role, int | None], ...]
    """Every op as it ran: FLOPs, bytes, kind, whose it is (FSDP's gather, such a gather again, its reduction, or
    the step's own), its pipeline stage."""
    activation_bytes: int
    stage_activations: dict[int | None, int]
    """Each pipeline stage's share of activation_bytes (empty without a pipeline)."""

    @classmethod
    def of(cls, r: Recorder) -> Run:
        return cls(dict(r.collectives), dict(r.collective_bytes), dict(r.regathers), dict(r.regather_bytes),
                   tuple(r.sequence), r.activation_bytes, dict(r.stage_activations))  # fmt: skip

    def stage(self, stage: int | None, to: int | None) -> Run:
        """What pipeline stage `stage` ran (None: what the rank ran before any), as stage `to`: its collectives, ops
        and activations."""

        def moved(counts: dict[CollectiveKey, int]) -> dict[CollectiveKey, int]:
            return {(*key[:4], to): n for key, n in counts.items() if key[4] == stage}

        alive = self.stage_activations.get(stage, 0)
        return Run(
            moved(self.collectives), moved(self.collective_bytes), moved(self.regathers), moved(self.regather_bytes),
            tuple((*op[:4], to) for op in self.sequence if op[4] == stage), alive,
            {} if stage is None else {to: alive},
        )  # fmt: skip

    @staticmethod
    def joined(runs: list[Run]) -> Run:
        """The runs of distinct stages as one rank running them all, in that order."""
        return Run(
            *({key: n for r in runs for key, n in getattr(r, field).items()}
              for field in ("collectives", "collective_bytes", "regathers", "regather_bytes")),
            tuple(op for r in runs for op in r.sequence), sum(r.activation_bytes for r in runs),
            {s: n for r in runs for s, n in r.stage_activations.items()},
        )  # fmt: skip

    def counted(self, regather: bool) -> tuple[dict, dict, Counter, int, int, Counter, Counter, Counter]:
        """(collective counts, their bytes, ops, FLOPs, activations, FSDP's forward gathers' ops, its reductions'
        ops, the recomputation's ops), without the backward's gathers if not `regather`."""
        counts, nbytes = Counter(self.collectives), Counter(self.collective_bytes)
        if not regather:
            counts.subtract(self.regathers)
            nbytes.subtract(self.regather_bytes)
        ops = Counter((f, b, kind) for f, b, kind, role, _ in self.sequence if regather or role != "regather")
        flops = sum(f * n for (f, _, _), n in ops.items())
        gathers, reductions, recomputed = (Counter((f, b, kind) for f, b, kind, r, _ in self.sequence if r == role)
                                           for role in ("gather", "reduce", "recompute"))  # fmt: skip
        return dict(counts), dict(nbytes), ops, flops, self.activation_bytes, gathers, reductions, recomputed

    def replicated(self, replicas: int) -> Run | None:
        """This run of FSDP alone (dp_replicate 1) as the rank of HSDP with `replicas` replicas of its shard group runs
        it: FSDP then all-reduces each reduce-scatter's output (its buffer over the shard group's size; the experts'
        too, reduced over the expert mesh's shard group) over dp_replicate; every op, every other collective and the
        activations are the same (tests/test_estimate_shared.py compares the result with the probe of the HSDP rank).
        None where it reduced nothing over a shard group."""
        counts, nbytes = dict(self.collectives), dict(self.collective_bytes)
        for key, n in self.collectives.items():
            axis, kind, phase, size, stage = key
            if kind != "reduce_scatter" or axis not in SHARD_AXES:
                continue
            buffer, rest = divmod(self.collective_bytes[key], size)
            if rest:
                return None
            reduced = ("dp_replicate", "all_reduce", phase, replicas, stage)
            counts[reduced] = counts.get(reduced, 0) + n
            nbytes[reduced] = nbytes.get(reduced, 0) + buffer
        if counts == self.collectives:
            return None
        return self._replace(collectives=counts, collective_bytes=nbytes)

    def at_rows(self, other: Run, t: tuple[int, int]) -> Run | None:
        """The run on the line through this one (at 0) and `other` (at 1) at t = t[0] / t[1], where both ran the
        same ops and collectives in the same order; None where they did not, or where a quantity is not a whole
        number there."""
        if (
            len(self.sequence) != len(other.sequence)
            or self.collectives != other.collectives
            or self.regathers != other.regathers
            or self.stage_activations.keys() != other.stage_activations.keys()
            or any(a[2:] != b[2:] for a, b in zip(self.sequence, other.sequence, strict=True))
        ):
            return None

        def line(x: int, y: int) -> int:
            step, rest = divmod(t[0] * (y - x), t[1])
            if rest or x + step < 0:
                raise _NotAffine
            return x + step

        try:
            return Run(
                self.collectives,
                {key: line(n, other.collective_bytes[key]) for key, n in self.collective_bytes.items()},
                self.regathers,
                {key: line(n, other.regather_bytes[key]) for key, n in self.regather_bytes.items()},
                tuple((line(a[0], b[0]), line(a[1], b[1]), *a[2:]) for a, b in zip(self.sequence, other.sequence)),
                line(self.activation_bytes, other.activation_bytes),
                {s: line(n, other.stage_activations[s]) for s, n in self.stage_activations.items()},
            )
        except _NotAffine:
            return None


class _NotAffine(Exception):
    pass


class Measurement:
    """The probes of a model cut to two sizes (or of the whole model), from which `at` gives any number of blocks."""

    def __init__(self, runs: list[Run], n: int, k: int, v: int, stages: int) -> None:
        self.runs = runs
        self.n, self.k, self.v, self.stages = n, k, v, stages
        self._counted: dict[bool, list[tuple]] = {}
        self._probes: dict[tuple[int | None, bool], Probe] = {}

    def at(self, blocks: int | None = None, regather: bool = True) -> Probe:
        """The probe of the probed rank holding `blocks` blocks (default: an even share of the model's);
        regather=False: as if FSDP kept the weights gathered from forward to backward (reshard_after_forward=False;
        the measurement must then reshard)."""
        if (blocks, regather) not in self._probes:
            self._probes[blocks, regather] = self._at(blocks, regather)
        return self._probes[blocks, regather]

    def _at(self, blocks: int | None, regather: bool) -> Probe:
        n, k, v = self.n, self.k, self.v
        held = (n * v // self.stages if blocks is None else blocks) if self.stages > 1 else n
        if regather not in self._counted:
            self._counted[regather] = [r.counted(regather) for r in self.runs]
        records = self._counted[regather]
        if len(records) == 1:
            a = b = records[0]
            scale = 0.0
            per_block = a[4] / held
        else:
            a, b = records
            # quantity(held) = quantity(2k v) + (held - 2k v) / (k v) * (quantity(3k v) - quantity(2k v))
            scale = (held - 2 * k * v) / (k * v)
            per_block = (b[4] - a[4]) / (k * v)
        exact = abs(scale - round(scale)) < 1e-9  # uneven pipeline stages land between two probed sizes

        def extend(x: int, y: int) -> int:
            value = x + scale * (y - x)
            if value < 0 or (exact and abs(value - round(value)) > 1e-6 * max(1.0, abs(value))):
                raise AssertionError(f"probe: a quantity is not linear in blocks ({x}, then {y} with {k * v} more)")
            return round(value)

        keys = a[0].keys() | b[0].keys()
        collectives = tuple(
            Collective(
                axis=axis, kind=kind, phase=phase, group_size=size, stage=stage,
                count=extend(a[0].get(key, 0), b[0].get(key, 0)), bytes=extend(a[1].get(key, 0), b[1].get(key, 0)),
            )
            for key in sorted(keys, key=str)
            for axis, kind, phase, size, stage in [key]
        )  # fmt: skip

        def extended(i: int) -> tuple[tuple[int, int, int, OpKind], ...]:
            ops = sorted((*key[:2], extend(a[i][key], b[i][key]), key[2]) for key in a[i].keys() | b[i].keys())
            return tuple(op for op in ops if op[2])

        return Probe(
            collectives=tuple(c for c in collectives if c.count),
            flops=extend(a[3], b[3]),
            ops=extended(2),
            gather_ops=extended(5),
            reduce_ops=extended(6),
            recompute_ops=extended(7),
            activation_bytes=extend(a[4], b[4]),
            block_activation_bytes=round(per_block),
        )

    @functools.cached_property
    def middle_block(self) -> Probe | None:
        """What one more block adds to the probed rank's micro batch: the difference of the two probes (k more blocks
        in each of its v stages) per block, its counts and bytes the mean of a period (fractions where k > 1 or its
        stages differ); of its ops, the step's own and their recomputation, not FSDP's gathers and reductions; its
        FSDP collectives as the probe that reshards runs them. Each block of the rank does at least this, so a
        layout of the same local shapes computes and keeps at least this much per block (`search`). None for a
        model probed whole, whose two probes are one."""
        if len(self.runs) == 1:
            return None
        a, b = self.runs
        span = self.k * self.v
        own = [
            Counter((f, m, kind) for f, m, kind, role, _ in run.sequence if role in ("", "recompute")) for run in (a, b)
        ]
        ops = tuple(sorted((f, m, (own[1][key] - own[0][key]) / span, kind) for key in own[0].keys() | own[1].keys()
                           for f, m, kind in [key] if own[1][key] != own[0][key]))  # fmt: skip
        merged: dict[tuple, list[float]] = {}  # per (axis, kind, phase, group size), over the stages
        for run, sign in ((a, -1), (b, 1)):
            for key, n in run.collectives.items():
                total = merged.setdefault(key[:4], [0.0, 0.0])
                total[0] += sign * n / span
                total[1] += sign * run.collective_bytes[key] / span
        collectives = tuple(
            Collective(axis=axis, kind=kind, phase=phase, group_size=size, count=n, bytes=nbytes, stage=None)
            for (axis, kind, phase, size), (n, nbytes) in sorted(merged.items(), key=str) if n or nbytes
        )  # fmt: skip
        alive = (b.activation_bytes - a.activation_bytes) / span
        return Probe(collectives=collectives, flops=sum(f * n for f, _, n, _ in ops), ops=ops, activation_bytes=alive,
                     block_activation_bytes=alive)  # fmt: skip

    def replicated(self, replicas: int) -> Measurement | None:
        """This measurement of FSDP alone as HSDP's with `replicas` replicas (`Run.replicated`); None where it cannot
        be derived."""
        runs = [r.replicated(replicas) for r in self.runs]
        if any(r is None for r in runs):
            return None
        return Measurement(runs, self.n, self.k, self.v, self.stages)

    def at_rows(self, rows: int, mine: int, other: Measurement, theirs: int) -> Measurement | None:
        """This measurement (of `mine` rows per micro batch) at `rows` rows, on the line through `other` (the same
        layout at `theirs` rows): each op's FLOPs and bytes, each collective's bytes and the activations are affine
        in the rows of a micro batch (attention is quadratic in the sequence, not in the rows), and the ops and
        collectives that run do not change with them, which is checked: ops are paired in the order they ran (an
        op's FLOPs and bytes change with the rows, its place does not). None where the two ran other ops (a
        dimension of size 1 takes other paths: one row is probed on its own) or a quantity is off the line."""
        if (self.n, self.k, self.v, self.stages, len(self.runs)) != (other.n, other.k, other.v, other.stages,
                                                                     len(other.runs)):  # fmt: skip
            return None
        t = (rows - mine, theirs - mine) if theirs > mine else (mine - rows, mine - theirs)
        runs = [a.at_rows(b, t) for a, b in zip(self.runs, other.runs, strict=True)]
        if any(r is None for r in runs):
            return None
        return Measurement(runs, self.n, self.k, self.v, self.stages)


def staged(pieces: list[tuple[Measurement, int, int]], stages: int) -> Measurement:
    """The measurement of a pp rank running, of a model's `stages` pipeline stages, those `pieces` name in the order
    it runs them: (a measurement, a stage it ran, the rank's stage that runs the same), the first one run first there
    too (a rank's first stage leaves a few more bytes alive than its others), with what the first measurement ran
    before any stage. Each stage of a rank holding several is its own module (and FSDP root) fed its own input, so
    what one records does not depend on the others the rank runs; both probes of a measurement hold 2k and 3k
    blocks in every stage (tests/test_estimate_shared.py checks the sum against the probe of the rank)."""
    first = pieces[0][0]
    runs = [
        Run.joined([first.runs[i].stage(None, None), *(m.runs[i].stage(s, to) for m, s, to in pieces)])
        for i in range(len(first.runs))
    ]
    return Measurement(runs, first.n, first.k, len(pieces), stages)
