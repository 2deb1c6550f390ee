"""The data loader's time per step, as a share of the main recipe's step time (goal: under 5%).

    python scripts/make_chat_model.py /tmp/chat       # the tiny BPE tokenizer (chat template) and chat.jsonl
    python scripts/bench_loader.py --chat /tmp/chat [--steps 40]

The step: recipes/llama_fsdp_tp.py's model, global batch and seq_len on one process (no mesh: the whole global batch
on this process's threads), with AdamW; the median of `--step-repeats` timed steps after two warm-up steps, batches
made beforehand. On the recipe's 4 ranks each rank loads half the rows and its step is no shorter, so the share here
is the larger one. The loader: `make_loader` for dp rank 0 of 1 with that batch, built once (tokenizing every
document, timed as startup), then `--steps` calls to `batch(k)` (cutting rows, packing, document masks, chat rows;
timed one by one; the share is the median's; the last column spreads startup over the recipe's steps). Cases: the recipe's data (the stdlib, byte-level tokens), with document masks, the stdlib through
the BPE tokenizer with document masks, and the chat file as SFT (format chat, whole conversations, document masks)
with a cold and a warm datasets cache.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from shardlab.cli.recipe import load_recipe
from shardlab.config import Config, DataConfig, MeshSpec
from shardlab.data.loader import make_loader
from shardlab.data.tokenizer import load_tokenizer
from shardlab.training.loop import build_model
from shardlab.training.step import init_state, make_step

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llama_fsdp_tp.py"


def step_time(cfg: Config, repeats: int) -> float:
    """Median seconds of one optimizer step of `cfg` on this process (loading excluded)."""
    cfg = msgspec.structs.replace(cfg, mesh=MeshSpec())
    model, plan, mesh = build_model(cfg)
    step, state = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
    loader = make_loader(cfg.data, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                         vocab_size=cfg.model.vocab_size, dp_rank=0, dp_size=1)  # fmt: skip
    batches = [loader.batch(k) for k in range(repeats + 2)]
    times = []
    for k, batch in enumerate(batches):
        start = time.perf_counter()
        state, _ = step(state, batch)
        if k >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def loader_times(cfg: Config, data: DataConfig, steps: int, tokenizer: str | None) -> tuple[float, float, float]:
    """Seconds to build the loader, of its first batch, and the median of the next `steps` - 1."""
    start = time.perf_counter()
    tok = None if tokenizer is None else load_tokenizer(tokenizer)
    loader = make_loader(data, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                         vocab_size=cfg.model.vocab_size, dp_rank=0, dp_size=1, tokenizer=tok)  # fmt: skip
    startup = time.perf_counter() - start
    times = []
    for k in range(steps):
        start = time.perf_counter()
        loader.batch(k)
        times.append(time.perf_counter() - start)
    return startup, times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat", type=Path, help="the output directory of scripts/make_chat_model.py")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = load_recipe(RECIPE).config
    torch.manual_seed(0)
    step = step_time(cfg, args.step_repeats)
    g, s = cfg.train.global_batch, cfg.train.seq_len
    print(f"step: {RECIPE.name} on one process, global batch {g} x seq {s}, threads {torch.get_num_threads()}: "
          f"{step * 1e3:.0f} ms (median of {args.step_repeats})")  # fmt: skip
    stdlib = cfg.data
    cases = [("stdlib, bytes (the recipe's data)", stdlib, None)]
    cases.append(("stdlib, bytes, document masks", msgspec.structs.replace(stdlib, document_masks=True), None))
    with tempfile.TemporaryDirectory() as cache:
        if args.chat is not None:
            tokenizer = str(args.chat / "model")
            masked = msgspec.structs.replace(stdlib, document_masks=True)
            cases.append(("stdlib, BPE tokenizer, document masks", masked, tokenizer))
            chat = DataConfig(source="files", paths=(str(args.chat / "chat.jsonl"),), format="chat",
                              document_masks=True, cache_dir=cache)  # fmt: skip
            cases.append(("chat SFT, document masks (cold cache)", chat, tokenizer))
            cases.append(("chat SFT, document masks (warm cache)", chat, tokenizer))
        run = cfg.train.steps * step
        print(f"\n| data | batch ms (median of {args.steps - 1}) | share of step | first batch ms | startup s | "
              f"startup / {cfg.train.steps} steps |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        for name, data, tokenizer in cases:
            startup, first, median = loader_times(cfg, data, args.steps, tokenizer)
            print(f"| {name} | {median * 1e3:.2f} | {100 * median / step:.2g}% | {first * 1e3:.1f} | {startup:.2f} | "
                  f"{100 * startup / run:.2g}% |")  # fmt: skip


if __name__ == "__main__":
    main()
