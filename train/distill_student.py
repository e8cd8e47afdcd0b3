"""The distilled student: copies of the target's layers (and final norm) trained while embeddings and LM head stay
shared (`make_student`), what of it is saved (`save_student`), where it starts (`warm_start`), and the FR-Spec
subset it is trained through (`student_subset`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from omegaconf import DictConfig

from models.pair import Pair, eos_ids
from models.student import decoder_parts, layer_subset, load_student, write_student_file
from utils.cli import UserError


def make_student(target, layers: list[int], own_norm: bool = True):
    """Trainable copies of the target's `layers` (+ final norm) in fp32; embeddings and LM head shared and frozen."""
    student = layer_subset(target, list(layers), share=False)
    inner = decoder_parts(student)
    if own_norm:
        inner.norm = copy.deepcopy(decoder_parts(target).norm)
    for p in student.parameters():
        p.requires_grad_(False)
    for module in own_modules(student, own_norm):
        module.float()
        for p in module.parameters():
            p.requires_grad_(True)
    return student.train()


def own_modules(student, own_norm: bool) -> list[torch.nn.Module]:
    inner = decoder_parts(student)
    return list(inner.layers) + ([inner.norm] if own_norm else [])


def student_state(student, own_norm: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors that differ from the target: the student's layers (and norm), nothing shared."""
    keep = lambda k: k.startswith("model.layers.") or (own_norm and k.startswith("model.norm."))  # noqa: E731
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in student.state_dict().items() if keep(k)}


def save_student(student, path: Path, info: dict, dtype: torch.dtype) -> Path:
    """Write the student file atomically (safetensors + JSON metadata that `load_student` reads)."""
    return write_student_file(Path(path), student_state(student, "norm" in info.get("own_modules", []), dtype), info)


def warm_start(student, target, scfg: DictConfig):
    """Start training from a student file (`student.init`, e.g. the shipped draft or an ablation's best) instead of
    the target's raw layers: a long run on new data need not relearn what a shorter one already did. The file must
    hold the same layers (and own norm); returns it loaded, for the `before` row."""
    start = load_student(target, str(scfg.init))
    info = start.student_info
    layers, own_norm = [int(i) for i in scfg.layers], bool(scfg.own_norm)
    if info["layers"] != layers or ("norm" in info.get("own_modules", [])) != own_norm:
        raise UserError(f"student.init={scfg.init} holds layers {info['layers']} (own norm: "
                        f"{'norm' in info.get('own_modules', [])}); set student.layers={info['layers']} and "
                        f"student.own_norm to match, or pick another file")
    student.load_state_dict(student_state(start, own_norm, torch.float32), strict=False)
    print(f"warm start from {scfg.init} (its step {info.get('step')}, {info.get('command', '')})", flush=True)
    return start


def student_subset(cfg: DictConfig, pair: Pair, target) -> torch.Tensor | None:
    """The FR-Spec ids the draft's head will score (`student.vocab_subset`, default: the pair's), or None."""
    n = cfg.student.get("vocab_subset")
    if not n:
        return None
    from models.lm_head import read_frequencies, subset_ids
    from models.pair import REPO_ROOT

    path = Path(str(cfg.student.vocab_freq))
    freq = read_frequencies(path if path.is_absolute() else REPO_ROOT / path)
    always = set(getattr(pair.tokenizer, "all_special_ids", []) or []) | eos_ids(target, pair.tokenizer)
    return subset_ids(freq, int(n), always, pair.vocab_size)
