"""Local tokenizers: text becomes the tokenizer's ids (documents between its BOS and EOS), a transformers model
directory's own tokenizer is the default, the tokenizer travels with every checkpoint and export, and bad
tokenizers are one line before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from shardlab.config import Config, DataConfig, LogConfig, MeshSpec, ModelConfig, TrainConfig
from shardlab.data.loader import make_loader
from shardlab.data.tokenizer import load_tokenizer, run_tokenizer, tokenizer_path

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def make_tokenizer(path: Path, vocab: int = 300) -> Path:
    """A BPE tokenizer trained here on a little text, saved as transformers saves one (chat template included)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([TEXT, "def main():\n    return 0\n"], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def loader(data: DataConfig, vocab_size: int = 512, tokenizer=None):
    return make_loader(
        data, seq_len=32, global_batch=2, vocab_size=vocab_size, dp_rank=0, dp_size=1, tokenizer=tokenizer
    )


def test_text_becomes_the_tokenizers_ids_between_bos_and_eos(tok_dir, tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    tok = load_tokenizer(str(tok_dir))
    data = DataConfig(source="files", paths=(str(tmp_path / "a.txt"),), tokenizer=str(tok_dir))
    got = loader(data, tokenizer=tok).batch(0).inputs[0]
    (want,) = tok.encode([TEXT])
    assert want[0] == tok.bos_id and want[-1] == tok.eos_id and want.size < len(TEXT) / 2  # BPE merged the words
    assert got.tolist() == want[:32].tolist()
    assert tok.decode(want[1:-1]) == TEXT
    byte_level = loader(DataConfig(source="files", paths=(str(tmp_path / "a.txt"),)))
    assert byte_level.fingerprint != loader(data, tokenizer=tok).fingerprint  # resuming across them is refused


def test_a_tokenizer_json_file_alone_is_enough(tok_dir, tmp_path):
    tok = load_tokenizer(str(tok_dir / "tokenizer.json"))
    assert tok.vocab_size == load_tokenizer(str(tok_dir)).vocab_size
    assert tok.bos_id is None and tok.encode(["fox"])[0].size >= 1  # no BOS/EOS known from the file alone


def test_a_model_directory_with_a_tokenizer_is_the_default(tok_dir, tmp_path):
    model_dir = tmp_path / "model"
    transformers.Qwen3Config(vocab_size=512, hidden_size=32).save_pretrained(model_dir)
    assert tokenizer_path(Config(model=ModelConfig(hf_path=str(model_dir)))) is None
    load_tokenizer(str(tok_dir))._tok.save_pretrained(model_dir)
    cfg = Config(model=ModelConfig(hf_path=str(model_dir)))
    assert tokenizer_path(cfg) == str(model_dir)
    explicit = msgspec.structs.replace(cfg, data=DataConfig(tokenizer=str(tok_dir)))
    assert tokenizer_path(explicit) == str(tok_dir)
    assert run_tokenizer(Config()) is None  # shardlab's Llama on the stdlib: bytes


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "nowhere", r"data.tokenizer='.*nowhere': no such file or directory"),
        (lambda p: p, r"no tokenizer.json in the directory"),
        (
            lambda p: (p / "tokenizer.json").write_text("{not json") and p / "tokenizer.json",
            r"not a readable tokenizer",
        ),
    ],
)
def test_a_bad_tokenizer_is_one_line(tmp_path, make, message):
    with pytest.raises(ValueError, match=message) as err:
        load_tokenizer(str(make(tmp_path)))
    assert "\n" not in str(err.value)


def test_a_tokenizer_larger_than_the_vocabulary_or_beside_bin_files_is_refused(tok_dir, tmp_path):
    tok = load_tokenizer(str(tok_dir))
    with pytest.raises(ValueError, match=r"has 300 tokens but model.vocab_size is 256"):
        loader(DataConfig(tokenizer=str(tok_dir)), vocab_size=256, tokenizer=tok)
    with pytest.raises(ValueError, match=r"data.tokenizer is set but data.source='synthetic'"):
        DataConfig(source="synthetic", tokenizer=str(tok_dir))
    with pytest.raises(ValueError, match=r"every file in data.paths is pre-tokenized .bin"):
        DataConfig(source="files", paths=("x.bin",), tokenizer=str(tok_dir))


def test_the_cli_checks_the_tokenizer_before_launch(tok_dir, capsys, monkeypatch):
    from shardlab.cli.main import main

    monkeypatch.chdir(ROOT)
    args = ["recipes/llama_fsdp_tp.py", "--model.vocab-size", "256", "--data.tokenizer", str(tok_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(r"has 300 tokens but model.vocab_size is 256", err), err


def trained_from_a_model_dir(tok_dir: Path, tmp_path: Path) -> Path:
    """A tiny Qwen3 directory (weights, generation_config.json, the tokenizer of `tok_dir`) trained one step into
    tmp_path/run, which holds its checkpoint; the directory is tmp_path/model."""
    from shardlab.training.loop import train

    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    load_tokenizer(str(tok_dir))._tok.save_pretrained(model_dir)
    cfg = Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(hf_path=str(model_dir)),
        train=TrainConfig(steps=1, global_batch=2, seq_len=16, run_dir=str(tmp_path / "run")),
        log=LogConfig(wandb="disabled", progress=False),
    )
    cfg = msgspec.structs.replace(cfg, checkpoint=msgspec.structs.replace(cfg.checkpoint, every=1))
    train(cfg)
    return tmp_path / "run"


def test_checkpoints_and_exports_carry_the_tokenizer(tok_dir, tmp_path):
    """A transformers model trained on its directory's tokenizer: the checkpoint holds the tokenizer's files and
    `export --to-hf` writes them, so transformers loads model and tokenizer (chat template included) from it."""
    from shardlab.training.export import export_to_hf

    run = trained_from_a_model_dir(tok_dir, tmp_path)
    step = run / "checkpoints" / "step-00000001"
    assert (step / "tokenizer.json").is_file() and (step / "tokenizer_config.json").is_file()
    export_to_hf(run, tmp_path / "hf")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert exported.chat_template == TEMPLATE
    assert exported("the lazy fox")["input_ids"] == load_tokenizer(str(tok_dir))._tok("the lazy fox")["input_ids"]
    assert np.array_equal(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").model.embed_tokens.weight.shape, (512, 32)
    )


def test_an_export_carries_the_generation_config_and_the_runs_tokenizer(tok_dir, tmp_path):
    """The export of a run trained from a transformers directory holds that directory's generation_config.json, and
    the run's tokenizer even from a checkpoint saved without its files (the tokenizer the run's config names)."""
    from shardlab.data.tokenizer import FILES
    from shardlab.training.export import export_to_hf

    run = trained_from_a_model_dir(tok_dir, tmp_path)
    generation = (tmp_path / "model" / "generation_config.json").read_bytes()
    export_to_hf(run, tmp_path / "hf")
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == generation
    step = run / "checkpoints" / "step-00000001"
    for name in [*FILES, "manifest.json"]:  # as a checkpoint saved before checkpoints carried the tokenizer
        (step / name).unlink(missing_ok=True)
    export_to_hf(run, tmp_path / "older")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "older" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "older").to_json_string() == (
        transformers.GenerationConfig.from_pretrained(tmp_path / "model").to_json_string()
    )
