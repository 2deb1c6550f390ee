"""Rules: glob semantics, first match wins (with the shadowed list), logical names -> PartitionSpec (Flax linen).

Run: pytest tests/test_rules.py -q
"""

from __future__ import annotations

import re

import msgspec
import pytest

from shardlab.sharding.rules import (
    Match,
    Rule,
    Rules,
    glob_regex,
    logical_to_spec,
    matches,
    matching,
    matching_any,
    resolve,
)
from shardlab.sharding.spec import P

# -- glob semantics ---------------------------------------------------------------------------------------

GLOBS = [
    # (pattern, fqn, matches)
    ("model.layers.*.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight", True),
    ("model.layers.*.mlp.up_proj.weight", "model.layers.17.mlp.up_proj.weight", True),
    ("model.layers.*.mlp.up_proj.weight", "model.layers.0.1.mlp.up_proj.weight", False),  # * stays in one component
    ("model.layers.*.mlp.up_proj.weight", "model.layers..mlp.up_proj.weight", True),  # * may be empty
    ("model.layers.*.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.bias", False),
    ("model.layers.*.mlp.up_proj.weight", "xmodel.layers.0.mlp.up_proj.weight", False),  # whole-name match
    ("model.layers.*.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight2", False),
    ("*.weight", "lm_head.weight", True),
    ("*.weight", "model.norm.weight", False),
    ("*", "scale", True),
    ("*", "model.scale", False),
    ("**", "scale", True),
    ("**", "model.layers.0.mlp.up_proj.weight", True),
    ("**.weight", "model.layers.0.mlp.up_proj.weight", True),
    ("**.weight", "lm_head.weight", True),
    ("**.weight", "weight", False),  # the dot is literal: ** then '.weight'
    ("model.**.weight", "model.layers.0.mlp.up_proj.weight", True),
    ("model.**.weight", "model.norm.weight", True),
    ("model.**.weight", "model.weight", False),  # '.**.' needs at least one component between the dots
    ("model.**", "model.norm.weight", True),
    ("layers.*_proj.weight", "layers.q_proj.weight", True),  # * inside a component
    ("layers.*_proj.weight", "layers.q_norm.weight", False),
    ("layers.?.w", "layers.3.w", True),
    ("layers.?.w", "layers.12.w", False),  # ? is exactly one character
    ("layers.?.w", "layers...w", False),  # ... and never a dot
    ("layers.??.w", "layers.12.w", True),
    ("a.b", "a.b", True),
    ("a.b", "axb", False),  # literal dots
    ("a+b.c(d)", "a+b.c(d)", True),  # regex metacharacters are literal
    ("a[0].w", "a[0].w", True),
    ("a[0].w", "a0.w", False),
    ("model.layers.*", "model.layers.3", True),  # module globs (FSDP units, blocks, activations)
    ("model.layers.*", "model.layers.3.mlp", False),
]


@pytest.mark.parametrize(("pattern", "fqn", "expected"), GLOBS)
def test_glob(pattern: str, fqn: str, expected: bool) -> None:
    assert matches(pattern, fqn) is expected


def test_matching_keeps_the_order_and_agrees_with_matches() -> None:
    names = tuple(dict.fromkeys(fqn for _, fqn, _ in GLOBS))
    for pattern in dict.fromkeys(p for p, _, _ in GLOBS):
        assert matching(pattern, names) == tuple(n for n in names if matches(pattern, n)), pattern
    assert matching("model.layers.*", ("model.layers.3", "model.norm", "model.layers.1")) == (
        "model.layers.3", "model.layers.1",
    )  # fmt: skip
    either = ("model.layers.*", "*")  # names matched by one pattern or the other, in their own order, once each
    assert matching_any(either, ("scale", "model.layers.3", "model.norm", "model.layers.1")) == (
        "scale", "model.layers.3", "model.layers.1",
    )  # fmt: skip


BAD_PATTERNS = ["", ".model.norm", "model.norm.", "model..norm", "."]


@pytest.mark.parametrize("pattern", BAD_PATTERNS)
def test_bad_pattern(pattern: str) -> None:
    message = f"rule pattern {pattern!r} is not a dotted name glob; write e.g. 'model.layers.*.mlp.up_proj.weight'"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        glob_regex(pattern)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        Rule(pattern=pattern, spec=(None,))  # checked when the rule is built, not when it is first used


# -- Rule -----------------------------------------------------------------------------------------------------

RULE_ERRORS = [
    (dict(pattern="a.b"), "rule 'a.b': give exactly one of spec= (mesh axes) or axes= (logical names)"),
    (
        dict(pattern="a.b", spec=("tp",), axes=("heads",)),
        "rule 'a.b': give exactly one of spec= (mesh axes) or axes= (logical names)",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), RULE_ERRORS)
def test_rule_needs_exactly_one_of_spec_and_axes(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        Rule(**kwargs)


def test_rule_accepts_empty_spec_and_axes() -> None:
    assert Rule(pattern="a", spec=()).spec == ()
    assert Rule(pattern="a", axes=()).axes == ()


def test_rules_round_trip_json() -> None:
    rules = Rules(
        params=(Rule(pattern="a.*", spec=(("tp", "cp"), None)), Rule(pattern="**", axes=("embed", None))),
        logical=(("embed", None), ("batch", ("dp_replicate", "dp_shard")), ("heads", "tp")),
        fsdp_units=(("a",), ("b", "c")),
        blocks=("a.*",),
    )
    assert msgspec.json.decode(msgspec.json.encode(rules), type=Rules) == rules


def test_rule_from_json_checks_its_pattern() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"rule pattern 'a\.\.b' is not a dotted name glob"):
        msgspec.json.decode(b'{"pattern": "a..b", "spec": [null]}', type=Rule)


# -- first match wins --------------------------------------------------------------------------------------

TABLE = Rules(
    params=(
        Rule(pattern="layers.*.attn.q.weight", spec=("tp", None)),  # 0
        Rule(pattern="layers.0.attn.*.weight", spec=(None, "tp")),  # 1: shadowed for q in layer 0 by 0
        Rule(pattern="layers.*.attn.*.weight", spec=(None, None)),  # 2
        Rule(pattern="**.bias", spec=("tp",)),  # 3
        Rule(pattern="**", spec=()),  # 4: catch-all (replicate)
        Rule(pattern="emb.weight", axes=("vocab", "embed")),  # 5: after the catch-all, so never wins
    ),
    logical=(("vocab", "tp"), ("embed", None)),
)

FIRST_MATCH = [
    # (fqn, ndim, spec, winning rule, shadowed rules)
    ("layers.0.attn.q.weight", 2, ("tp", None), 0, (1, 2, 4)),
    ("layers.5.attn.q.weight", 2, ("tp", None), 0, (2, 4)),
    ("layers.0.attn.k.weight", 2, (None, "tp"), 1, (2, 4)),
    ("layers.5.attn.k.weight", 2, (None, None), 2, (4,)),
    ("layers.5.attn.k.bias", 1, ("tp",), 3, (4,)),
    ("norm.weight", 1, (None,), 4, ()),  # a short spec is padded with None to the parameter's ndim
    ("emb.weight", 2, (None, None), 4, (5,)),
    ("scalar", 0, (), 4, ()),
]


@pytest.mark.parametrize(("fqn", "ndim", "spec", "rule", "shadowed"), FIRST_MATCH)
def test_first_match_wins(fqn: str, ndim: int, spec: tuple, rule: int, shadowed: tuple[int, ...]) -> None:
    assert resolve(fqn, ndim, TABLE) == Match(spec=spec, rule=rule, shadowed=shadowed)


def test_no_rule_matches() -> None:
    rules = Rules(params=(Rule(pattern="a.*", spec=()),))
    assert resolve("b.weight", 2, rules) is None


def test_rule_with_more_entries_than_dims() -> None:
    rules = Rules(params=(Rule(pattern="x", spec=()), Rule(pattern="**.bias", spec=("tp", None))))
    with pytest.raises(
        ValueError, match=r"^fc\.bias: rule 1 '\*\*\.bias' gives 2 entries for a 1-dim parameter; fix the rule$"
    ):
        resolve("fc.bias", 1, rules)


def test_logical_rule_resolves_through_the_table() -> None:
    rules = Rules(
        params=(Rule(pattern="**.weight", axes=("heads", "embed")),),
        logical=(("heads", "tp"), ("embed", "tp"), ("embed", None)),
    )
    assert resolve("a.weight", 2, rules) == Match(spec=("tp", None), rule=0, fallbacks=("embed->None",))


def test_logical_rule_with_unknown_name_names_the_parameter() -> None:
    rules = Rules(params=(Rule(pattern="**", axes=("heads",)),), logical=(("embed", None),))
    with pytest.raises(
        ValueError,
        match=r"^a\.weight: logical axis 'heads' has no entry in the logical table; add \('heads', None\) to replicate it$",
    ):
        resolve("a.weight", 1, rules)


# -- logical -> mesh axes (Flax linen semantics) -----------------------------------------------------------

LOGICAL = (
    ("batch", ("dp_replicate", "dp_shard")),
    ("vocab", "tp"),
    ("heads", "tp"),
    ("embed", "tp"),  # preferred, but usually taken: then ...
    ("embed", None),  # ... this fallback applies, and is reported
    ("seq", "cp"),
    ("mlp", ("tp", "cp")),  # tuple: all-or-nothing
    ("mlp", "tp"),
    ("norm", None),
    ("kv", "cp"),
    ("kv", "tp"),
)

LOGICAL_CASES = [
    # (logical dim names, expected spec, expected fallbacks)
    (("vocab", "embed"), P("tp", None), ("embed->None",)),
    (("embed", "vocab"), P(None, "tp"), ("embed->None",)),  # vocab's pair comes first in the table, so it wins tp
    (("embed",), P("tp"), ()),  # tp free: the preferred pair applies
    (("norm",), P(None), ()),  # a pair to None is a choice, not a fallback
    (("batch", "seq", "embed"), P(("dp_replicate", "dp_shard"), "cp", "tp"), ()),
    (("mlp", "embed"), P(None, "tp"), ("mlp->None",)),  # embed's pair precedes mlp's: embed takes tp, mlp gets nothing
    (("mlp", "norm"), P(("tp", "cp"), None), ()),  # mlp takes its whole tuple
    (("seq", "mlp"), P("cp", "tp"), ("mlp->tp",)),  # cp taken: the tuple is all-or-nothing, so mlp falls back to tp
    (("mlp", "seq"), P("tp", "cp"), ("mlp->tp",)),  # order of the table, not of the tensor: seq claims cp first
    (("heads", "kv"), P("tp", "cp"), ()),
    (("seq", "kv"), P("cp", "tp"), ("kv->tp",)),
    (("vocab", "heads"), P("tp", None), ("heads->None",)),  # every pair blocked: replicated, and reported
    ((None, "embed"), P(None, "tp"), ()),  # explicit None: replicated, not looked up
    ((None, None), P(None, None), ()),
    ((), P(), ()),
]


@pytest.mark.parametrize(("axes", "spec", "fallbacks"), LOGICAL_CASES)
def test_logical_to_spec(axes: tuple, spec: P, fallbacks: tuple[str, ...]) -> None:
    got, got_fallbacks = logical_to_spec(axes, LOGICAL)
    assert got == spec
    assert isinstance(got, P)
    assert got_fallbacks == fallbacks


def test_logical_to_spec_never_uses_an_axis_twice() -> None:
    names = [n for n, _ in LOGICAL]
    for a in names:
        for b in names:
            if a == b:
                continue
            spec, _ = logical_to_spec((a, b), LOGICAL)
            used = spec.used_axes
            assert len(used) == len(set(used)), (a, b, spec)


def test_logical_fallback_reports_a_tuple_fallback() -> None:
    table = (("seq", "cp"), ("batch", ("dp_shard", "cp")), ("batch", ("dp_replicate", "dp_shard")))
    assert logical_to_spec(("batch", "seq"), table) == (
        P(("dp_replicate", "dp_shard"), "cp"),
        ("batch->('dp_replicate', 'dp_shard')",),
    )


UNKNOWN_LOGICAL = [
    (
        ("vocab", "hidden"),
        "w: logical axis 'hidden' has no entry in the logical table; add ('hidden', None) to replicate it",
    ),
    (("hidden",), "w: logical axis 'hidden' has no entry in the logical table; add ('hidden', None) to replicate it"),
]


@pytest.mark.parametrize(("axes", "message"), UNKNOWN_LOGICAL)
def test_unknown_logical_name(axes: tuple, message: str) -> None:
    # Unlike Flax (which replicates a name without a rule silently), an unknown name is an error.
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        logical_to_spec(axes, LOGICAL, name="w")


def test_unknown_logical_name_default_where() -> None:
    with pytest.raises(ValueError, match=r"^tensor: logical axis 'hidden'"):
        logical_to_spec(("hidden",), LOGICAL)


def test_rules_built_with_lists_resolve_as_rules_of_tuples():
    """resolve keeps its answers by rules (a search plans one model on hundreds of meshes); rules whose fields are
    lists cannot be kept, and resolve the same."""
    rule = Rule(pattern="layers.*.wq", spec=("tp", None))
    want = resolve("layers.3.wq", 2, Rules(params=(rule,)))
    assert want is not None and want.spec == ("tp", None)
    assert resolve("layers.3.wq", 2, Rules(params=[rule])) == want
