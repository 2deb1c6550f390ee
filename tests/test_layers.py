"""The data flow stays one-way (config -> plan -> apply -> step -> loop): a module imports only modules of its own or earlier layers."""

import ast
from pathlib import Path

LAYERS = [
    {
        "_base",
        "_glob",
        "_faults",
        "_preemption",
        "_malloc",
        "_strided",
        "_activation_checkpoint",
        "_compile",
        "_torchrun",
        "_manifest",
        "_forked",
        "_cache_dir",
        "estimate._fake",
    },
    {"mesh", "_device_mesh"},
    {"pipeline"},
    {"model_config", "config"},
    {"packing"},
    {"spec", "rules", "hf.names"},
    {"context_parallel", "expert_parallel", "styles"},
    {"models.moe", "models.llama", "models.llama_rules", "_plan_text", "plan", "search"},
    {"stages"},
    {
        "apply",
        "debug",
        "documents",
        "data",
        "loss",
        "hf_datasets",
        "chat",
        "metrics",
        "launch",
        "tokenizer",
        "models.provider",
        "models.hf_rules",
        "models.hf_causal_lm",
        "models.custom",
        "hf.io",
        "hf.transformers_names",
        "hf.export",
        "hf",
    },
    {"schedule", "routers"},
    {"step"},
    {"evaluate"},
    {"estimate.recorder"},
    {"estimate.probe"},
    {
        "estimate.kernels",
        "estimate.roofline",
        "estimate.cpu",
        "estimate.floors",
        "estimate.probe_store",
        "estimate.block_counts",
    },
    {"estimate", "estimate.shared", "estimate.search", "checkpoint"},
    {"loop", "recipe", "estimate.search_report"},
    {"__main__", "__init__"},
]
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}
PACKAGE = Path(__file__).resolve().parents[1] / "shardlab"


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardlab"):
            base = node.module.removeprefix("shardlab").removeprefix(".")
            names |= {base} if base else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("shardlab.") for a in node.names if a.name.startswith("shardlab.")}
    return names


def module_name(path: Path) -> str:
    """`estimate/probe.py` -> estimate.probe; a package's `__init__.py` is the package (`estimate`)."""
    name = str(path.relative_to(PACKAGE).with_suffix("")).replace("/", ".")
    return name.removesuffix(".__init__") if name != "__init__" else name


def test_every_module_has_a_layer():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    modules.discard("models")
    assert modules <= set(LAYER_OF), f"add to LAYERS: {sorted(modules - set(LAYER_OF))}"


def test_imports_only_flow_left():
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name not in LAYER_OF:
            continue
        for dep in imported(path):
            dep = dep if dep in LAYER_OF else dep.split(".")[0]
            assert LAYER_OF.get(dep, -1) <= LAYER_OF[name], (
                f"{name} (layer {LAYER_OF[name]}) imports {dep} (layer {LAYER_OF.get(dep)})"
            )
