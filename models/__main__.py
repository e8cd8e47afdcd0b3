"""`python -m models pair=NAME`: load a pair and print what the other stages will see (a quick check of a config)."""

from __future__ import annotations

import time

from omegaconf import DictConfig

from models.pair import load_pair
from utils.cli import hydra_entry


@hydra_entry("models")
def main(cfg: DictConfig) -> None:
    start = time.perf_counter()
    pair = load_pair(cfg.pair)
    elapsed = time.perf_counter() - start
    n_draft = sum(p.numel() for p in pair.draft.parameters())
    n_target = sum(p.numel() for p in pair.target.parameters())
    print(f"pair {pair.pair_id}: target {n_target / 1e6:.1f}M params, draft {n_draft / 1e6:.1f}M params "
          f"(shared embeddings counted in both), vocab {pair.vocab_size}, tokenizer {pair.tokenizer_hash}, "
          f"{pair.dtype} on {pair.device}, chat template {'on' if pair.chat_template else 'off'}, loaded in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
