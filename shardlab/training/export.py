"""A run's checkpoint as a Hugging Face directory (`python -m shardlab export`): the newest intact step (or a given
one) read on one process, resharded by DCP from whatever layout saved it, written through the provider of the model it
holds, with the run's tokenizer and the model directory's generation config beside the weights."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from shardlab._errors import ShardlabError
from shardlab.config import Config
from shardlab.data.tokenizer import FILES as TOKENIZER_FILES
from shardlab.data.tokenizer import load_tokenizer, tokenizer_path
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import ModelProvider, first_difference
from shardlab.training.checkpoint import STATE_FILE, damage, newest_intact, one_process, saved_identity, verify, warn


def export_to_hf(source: Path, out: Path, model: ModelProvider | None = None) -> Path:
    """Write a checkpoint's model weights as a Hugging Face directory; `source` is a run or step directory.

    One process, no process group: DCP reshards whatever layout saved it into plain full tensors. `model`: the
    provider of a recipe's own model (its recipe's `model`; it must be the model the checkpoint holds); shardlab's
    Llama and transformers models are known from the checkpoint itself.
    """
    from shardlab.hf import to_hf

    if (source / STATE_FILE).is_file():
        step = source
        if (problem := damage(step)) is not None:
            raise ShardlabError(f"export: {str(step)!r}: {problem}; export another step")
    else:
        step, skipped = newest_intact(source / "checkpoints")
        if step is None and skipped:
            raise ShardlabError(
                f"export: no intact checkpoint in {str(source / 'checkpoints')!r} (newest {skipped[0]}); nothing "
                "to export until a checkpoint is restored or trained again"
            )
        if step is None:
            raise ShardlabError(
                f"export: {str(source)!r} holds no committed checkpoint (no checkpoints/step-*); give a run or step "
                "directory"
            )
        for line in skipped:
            warn(f"export skips {line}; exporting {step.name}")
    config_file = step / "config.json"
    if not config_file.is_file():
        raise ShardlabError(f"export: {str(step)!r} has no config.json; it is not a shardlab checkpoint")
    cfg = msgspec.json.decode(config_file.read_bytes(), type=Config)
    provider = saved_provider(step, cfg, model)
    provider.hf_config()  # a model without a transformers mapping fails here, before anything is read
    with torch.device("meta"):
        model = provider.build()
    provider.materialize(model, "cpu", cfg.train.seed)
    tensors = {"model": get_model_state_dict(model)}
    verify(step, tensors["model"], fix="export another step")
    with one_process(True):
        dcp.load(tensors, checkpoint_id=str(step), no_dist=True)
    set_model_state_dict(model, tensors["model"])
    to_hf(model, out, provider=provider, extra_files=_export_files(step, cfg))
    return step


GENERATION_CONFIG = "generation_config.json"


def _export_files(step: Path, cfg: Config) -> dict[str, bytes]:
    """What an export writes beside the weights: the run's tokenizer, as the checkpoint saved it (a checkpoint saved
    without its files: the tokenizer the run's config names, where it still is), and the generation_config.json of
    the transformers model directory the run trained from (model.hf_path), when it has one."""
    files = {name: (step / name).read_bytes() for name in TOKENIZER_FILES if (step / name).is_file()}
    if not files and (path := tokenizer_path(cfg)) is not None:
        if Path(path).exists():
            files = load_tokenizer(path).files()
        else:
            warn(f"export: the run's tokenizer {path!r} is neither in the checkpoint nor there; the export has none")
    if cfg.model.hf_path is not None:
        generation = Path(cfg.model.hf_path) / GENERATION_CONFIG
        if generation.is_file():
            files[GENERATION_CONFIG] = generation.read_bytes()
        elif not Path(cfg.model.hf_path).is_dir():
            warn(f"export: model.hf_path={cfg.model.hf_path!r} is gone; the export has no {GENERATION_CONFIG} from it")
    return files


def saved_provider(step: Path, cfg: Config, model: ModelProvider | None = None) -> ModelProvider:
    """The model a checkpoint holds, from what the checkpoint itself says (a transformers model's config is in its
    model.json, so the export needs neither its directory nor its recipe); a recipe's own model comes from its
    recipe (`model`), checked against the checkpoint."""
    identity = saved_identity(step) or {}
    if "model.factory" in identity:
        if model is None:
            raise ShardlabError(
                f"export: {str(step)!r} holds a recipe's own model ({identity['model.factory']}); pass its recipe: "
                "`export RUN_DIR --to-hf OUT --recipe RECIPE`"
            )
        if (key := first_difference(identity, model.identity())) is not None:
            raise ShardlabError(
                f"export: the recipe's model differs from the checkpoint's in {key} (checkpoint "
                f"{identity.get(key)!r}, recipe {model.identity().get(key)!r}); pass the recipe the run was trained with"
            )
        return model
    transformers = any(k.startswith("config.json:") for k in identity)
    if model is not None:
        held = "a transformers model" if transformers else "shardlab's Llama"
        raise ShardlabError(f"export: {str(step)!r} holds {held}, not a recipe's own model; leave out --recipe")
    if transformers:
        from shardlab.models.transformers.provider import HFCausalLM

        return HFCausalLM.from_identity(identity)
    return LlamaProvider(cfg.model)
