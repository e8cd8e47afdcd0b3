"""Drafts made from the target: a subset of its layers sharing its embeddings, final norm and LM head
(`layer_subset`), and a distilled student file from `train.distill` stored as what differs from the target
(`read_student_file` / `write_student_file` / `load_student`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from utils.cli import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent


def decoder_parts(model):
    """The decoder stack of a Llama-like model (Llama, Qwen2, Mistral, SmolLM): `model.model.layers`."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise UserError(f"layer-subset drafts need a Llama-like model (model.model.layers); got {type(model).__name__}")
    return inner


def _reindexed(module: torch.nn.Module, idx: int) -> torch.nn.Module:
    """A shallow clone sharing all parameters, with every `layer_idx` set to `idx` (the KV-cache slot)."""
    clone = copy.copy(module)
    clone._modules = {name: _reindexed(child, idx) for name, child in module._modules.items()}
    if hasattr(module, "layer_idx"):
        clone.layer_idx = idx
    return clone


def layer_subset(target, layers: list[int], share: bool = True):
    """A draft made of the target's `layers`, sharing embeddings, final norm, rotary tables and LM head.

    With `share=True` the layers' weights are shared too (no memory cost); with `share=False` they are copied, so a
    student can be trained (or have its own weights loaded) without touching the target.
    """
    inner = decoder_parts(target)
    n = len(inner.layers)
    if not layers or any(not 0 <= i < n for i in layers):
        raise UserError(f"layer subset {list(layers)} must be non-empty indices of the target's {n} layers")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    with torch.device("meta"):
        draft = type(target)(config)
    d_inner = decoder_parts(draft)
    d_inner.embed_tokens = inner.embed_tokens
    d_inner.norm = inner.norm
    if hasattr(inner, "rotary_emb"):
        d_inner.rotary_emb = inner.rotary_emb
    draft.lm_head = target.lm_head
    new_layers = []
    for j, i in enumerate(layers):
        layer = inner.layers[i] if share else copy.deepcopy(inner.layers[i])
        new_layers.append(layer if (share and i == j) else _reindexed(layer, j))
    d_inner.layers = torch.nn.ModuleList(new_layers)
    leftover = [name for name, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if leftover:
        raise UserError(f"layer subset of {type(target).__name__} left uninitialised tensors: {leftover[:3]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


STUDENT_META = "specstop_student"


def read_student_file(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a student file; refuses a safetensors file without the student metadata."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata() or {}
        if STUDENT_META not in meta:
            raise UserError(f"{path} is not a train.distill student file (no '{STUDENT_META}' metadata)")
        return json.loads(meta[STUDENT_META]), {k: fh.get_tensor(k) for k in fh.keys()}


def write_student_file(path: Path, tensors: dict[str, torch.Tensor], info: dict) -> Path:
    """Write a student file atomically: the tensors and the JSON metadata `read_student_file` reads."""
    from safetensors.torch import save_file

    from utils.files import atomic_write

    return atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp),
                                                          metadata={STUDENT_META: json.dumps(info, default=str)}))


def load_student(target, path: str | Path):
    """A distilled student: the target's layers named in the file's metadata, overwritten by the file's tensors.

    The file holds only what differs from the target (the student's layers and final norm); embeddings and LM head
    stay shared with the target, which is why it stays small.
    """
    path = Path(path)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_file():
        raise UserError(f"student weights {path} not found; run `python -m train.distill` or check draft.weights")
    info, tensors = read_student_file(path)
    draft = layer_subset(target, info["layers"], share=False)
    if "norm" in info.get("own_modules", []):
        decoder_parts(draft).norm = copy.deepcopy(decoder_parts(target).norm)
    own = draft.state_dict()
    unknown = [k for k in tensors if k not in own]
    if unknown:
        raise UserError(f"student file {path} has tensors the draft lacks ({unknown[:3]}); it was made for another target")
    dtype = next(target.parameters()).dtype
    draft.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    draft.student_info = info
    return draft.eval()
