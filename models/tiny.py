"""`pair=tiny_random`: a tiny random Llama target on a character vocabulary (its config adds a layer-subset draft).

Built in memory from a seed in well under a second, so every stage's logic is testable on 2 CPU cores. The draft
shares the target's first layers, embeddings and head, so draft and target agree often but not always — both
acceptance and rejection paths get exercised.
"""

from __future__ import annotations

import string

import torch
from omegaconf import DictConfig

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def tiny_tokenizer():
    """A character-level fast tokenizer: printable ASCII plus four specials (vocab ~104)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_target(t: DictConfig):
    """(target, tokenizer) for a `source: tiny_random` target config; the draft is built like any other."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=int(t.get("hidden_size", 64)),
        intermediate_size=int(t.get("intermediate_size", 128)),
        num_hidden_layers=int(t.get("num_layers", 4)),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=int(t.get("max_position_embeddings", 512)),
        tie_word_embeddings=True,
        initializer_range=float(t.get("initializer_range", 0.2)),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(int(t.get("seed", 0)))
        target = LlamaForCausalLM(config).eval()
    return target, tok
