"""Recipes: a Python file holding `config = Config(...)` (and optionally `rules`), loaded without exec-into-globals.

The recipe's values become the defaults that tyro shows in `--help` and that overrides change.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from shardlab._errors import ShardlabError
from shardlab.config import Config
from shardlab.models.provider import ModelProvider
from shardlab.sharding.rules import Rules

RulesArg = Rules | Callable[[Config], Rules] | None
ModelArg = ModelProvider | Callable[[Config], ModelProvider] | None


class Recipe:
    """A loaded recipe file: its default `config`, its `rules` (None = the model's default rules) and its own
    `model` (None = the model the config names)."""

    def __init__(self, path: Path, config: Config, rules: RulesArg, model: ModelArg = None) -> None:
        self.path, self.config, self._rules, self._model = path, config, rules, model

    def rules(self, cfg: Config) -> Rules | None:
        return self._rules(cfg) if callable(self._rules) else self._rules

    def model(self, cfg: Config) -> ModelProvider | None:
        return self._model(cfg) if callable(self._model) and not isinstance(self._model, ModelProvider) else self._model


def load_recipe(path: str | Path) -> Recipe:
    """Import a recipe file by path; one-line errors for a missing file or a file without `config`."""
    path = Path(path)
    if not path.is_file():
        raise ShardlabError(f"recipe: no file {str(path)!r}; pass the path of a recipe, e.g. recipes/llama_fsdp_tp.py")
    if path.suffix != ".py":
        raise ShardlabError(
            f"recipe {str(path)!r} is not a Python file; a recipe is a .py file holding `config = Config(...)`, e.g. "
            "recipes/llama_fsdp_tp.py"
        )
    spec = importlib.util.spec_from_file_location(f"shardlab_recipe_{path.stem}", path)
    module: ModuleType = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a user's file: any error in it is reported as one line naming the file
        raise ShardlabError(f"recipe {str(path)!r}: {type(err).__name__}: {err}") from err
    config = getattr(module, "config", None)
    if not isinstance(config, Config):
        got = "nothing" if config is None else type(config).__name__
        raise ShardlabError(
            f"recipe {str(path)!r}: `config` must be a shardlab.Config, found {got}; add `config = Config(...)`"
        )
    rules = getattr(module, "rules", None)
    if rules is not None and not (isinstance(rules, Rules) or callable(rules)):
        raise ShardlabError(f"recipe {str(path)!r}: `rules` must be a shardlab.Rules or a function Config -> Rules")
    model = getattr(module, "model", None)
    if model is not None and not (isinstance(model, ModelProvider) or callable(model)):
        raise ShardlabError(
            f"recipe {str(path)!r}: `model` must be a shardlab model provider (e.g. shardlab.CustomModel(...)) or a "
            "function Config -> provider"
        )
    return Recipe(path, config, rules, model)
