"""Stop policies: after each drafted token, continue drafting or hand the round to the target?

One interface, shaped like transformers' candidate generator (`update_candidate_strategy` after each verification):
- `reset(**ctx)` once per prompt (the oracle receives its lookahead there);
- `should_stop(step: DraftStep) -> bool` after each drafted token (the token is kept in the round either way);
- `observe(drafted, accepted)` after each verification (the heuristic and AdaEDL adapt there).
The loop itself enforces `max_len` (every policy has a cap), the token budget and EOS.

Class attributes tell the loop what to compute: `needs_probs` (q as a distribution — greedy constant/heuristic/oracle
skip the softmax), `needs_hidden` (the draft's last hidden state), `needs_context` (DraftStep.context: prompt +
committed output), `needs_verify_stats` (DraftStep.verify: the last verification's target statistics), `greedy_only`,
`approximate` (SPRINTER verification instead of exact). And they tell decode, the replay and the bar what a policy is:
`needs_profile` (its stop rule reads the measured cost profile), `learned` (reads a trained head: `name:PATH`),
`oracle` (reads the target's output), `external` (runs its own loop, decode/hf.py), `trace_score` (the per-token
score it thresholds, for the replay's AUROC column). Nothing outside this class reads a policy's name.

The policies themselves live by family: decode.rules (the training-free rules: constant, heuristic, oracle,
max-confidence, SVIP, AdaEDL), decode.expected_value (the expected-value stop rule and its calibrated scores),
decode.learned (trained heads, SPRINTER's verifier). This module holds the interface and finding/building by name.

A policy is found by name: `conf/policy/<name>.yaml` on Hydra's config search path (utils.discover; a user's conf dir
added with `hydra.searchpath=[file:///DIR]` counts), whose `_target_` names the class and whose other keys are its
defaults (with their sources). So adding a policy is one StopPolicy subclass + one yaml (docs/adding_a_policy.md).
decode.yaml holds an open `policy: {}` dict; a listed policy's yaml is read when the policy is built and
`policy.<name>.<param>=V` is merged over it (decode.methods).
"""

from __future__ import annotations

from pathlib import Path

from models.features.signals import DraftStep
from utils.cli import UserError


class StopPolicy:
    name = "base"
    needs_probs = True
    needs_hidden = False
    needs_context = False
    needs_verify_stats = False
    greedy_only = False
    approximate = False
    oracle = False
    needs_profile = False  # the stop rule reads the measured cost profile: built with profile=
    learned = False  # reads a trained head: listed as `name:PATH` (or policy_ckpt / policy.<name>.ckpt), built with it
    external = False  # runs its own loop (transformers' generate, decode/hf.py), not decode.loop: built with pair=
    trace_score: str | None = None  # the per-token score it thresholds, as a trace score (`max_q` | `neg_entropy`)
    tree = False  # a tree builder (decode.tree_builders): the loop drafts and verifies a token tree, not a chain

    def __init__(self, max_len: int = 40):
        if int(max_len) < 1:
            raise UserError(f"policy.{self.name}.max_len must be ≥ 1, got {max_len}")
        self.max_len = int(max_len)

    def reset(self, **ctx) -> None:
        """Per prompt. Adaptive state that should carry across prompts (AdaEDL's λ) is kept unless documented."""

    def should_stop(self, step: DraftStep) -> bool:
        return False

    def observe(self, drafted: int, accepted: int) -> None:
        """After each verification: `drafted` tokens were proposed in the round, `accepted` of them kept."""

    def describe(self) -> dict:
        return {"name": self.name, "max_len": self.max_len}

    @classmethod
    def wants_profile(cls, params: dict, bundle=None) -> bool:
        """Whether a policy built with `params` (and, for a learned one, its head) reads the cost profile."""
        return cls.needs_profile


# ------------------------------------------------------------------------------------------- finding and building


def policy_config(name: str, cfg=None) -> dict | None:
    """conf/policy/<name>.yaml (on the config search path of `cfg` or the running app) as a dict; None: no such file."""
    from utils import discover

    return discover.load("policy", name, cfg)


def policy_target(name: str, cfg=None) -> str | None:
    """The `_target_` of a policy's yaml, checked to name a StopPolicy (None: no such policy)."""
    from utils import discover

    path = discover.find("policy", name, cfg)
    if path is None:
        return None
    target = discover.read(path).get("_target_")
    _class_of(target, name, discover.shown(path))
    return str(target)


def policy_class(name: str, cfg=None) -> type[StopPolicy] | None:
    """The class of the policy called `name` (None: no conf/policy/<name>.yaml on the search path)."""
    target = policy_target(name, cfg)
    return None if target is None else _class_of(target, name)


def _class_of(target, name: str, where: str | None = None) -> type[StopPolicy]:
    from utils import discover

    return discover.target_class(target, StopPolicy, f"policy '{name}' ({where or f'conf/policy/{name}.yaml'})")


def known_policies(cfg=None) -> list[str]:
    """Every policy name on the search path, sorted."""
    from utils import discover

    return discover.names("policy", cfg)


def _head_policies(cfg=None) -> list[str]:
    """The policies that take a head checkpoint (`learned`), for error messages; unloadable yamls are left out."""
    out = []
    for name in known_policies(cfg):
        try:
            cls = policy_class(name, cfg)
        except UserError:
            continue
        if cls is not None and cls.learned:
            out.append(name)
    return out


def split_spec(spec: str) -> tuple[str, str | None]:
    """`name` or `name:PATH` → (name, path), unchecked."""
    name, _, path = str(spec).partition(":")
    return name.strip(), (path or None)


def parse_spec(spec: str, cfg=None) -> tuple[str, str | None]:
    """`name` or `name:PATH` (learned heads) → (name, path), for a policy found on the search path (or `target`)."""
    name, path = split_spec(spec)
    cls = policy_class(name, cfg) if name != "target" else None
    if cls is None and name != "target":
        heads = " or ".join(f"{h}:PATH" for h in _head_policies(cfg))
        raise UserError(f"unknown policy '{name}'; known: {', '.join(['target', *known_policies(cfg)])} "
                        f"(heads as {heads})")
    if path and (cls is None or not cls.learned):
        heads = " and ".join(f"{h}:PATH" for h in _head_policies(cfg))
        raise UserError(f"policy '{name}' takes no checkpoint; only {heads} do")
    return name, path


def build_policy(spec: str, params: dict | None = None, pair=None, ckpt: str | None = None,
                 profile=None, target: str | None = None) -> StopPolicy:
    """A policy from its spec (`svip`, `learned:PATH`) and its params (conf/policy/<name>.yaml + overrides), built by
    `hydra.utils.instantiate` from its class (`target`: the yaml's `_target_`, found by name when not given) and the
    params; what else the class gets follows its capabilities: `external` → the pair, `learned` → its head,
    `wants_profile` → `profile` (models.cost, measured for the pair when not given)."""
    from hydra.utils import instantiate

    name, path = parse_spec(spec) if target is None else split_spec(spec)
    if name == "target":
        raise UserError("'target' is target-only decoding, not a stop policy")
    target = target or policy_target(name)
    cls = _class_of(target, name)
    params = {k: v for k, v in dict(params or {}).items() if k not in ("ckpt", "_name")}
    # a partial: the pair, the head and the profile are objects handed to the constructor, not config values
    make = instantiate({"_target_": target, **params}, _partial_=True, _convert_="all")
    see = f"; see conf/policy/{name}.yaml"
    if cls.external:
        if pair is None:
            raise UserError(f"'{name}' runs transformers' generate and needs the pair")
        return _call(make, {"pair": pair}, name, see)
    extra: dict = {}
    bundle = None
    if cls.learned:
        bundle = _load_bundle(name, path or ckpt, pair)
        extra["bundle"] = bundle
    if cls.wants_profile(params, bundle):  # the profile only for a rule that reads it; measured once, then cached
        if profile is None and pair is not None:
            from models.profiling import get_profile

            profile = get_profile(pair)
        extra["profile"] = profile
    return _call(make, extra, f"policy {name}", "" if cls.learned else see)


def _load_bundle(name: str, path: str | None, pair):
    """A learned policy's head, checked against the pair and moved to its device (features stay there: no copy per
    drafted token)."""
    if not path:
        raise UserError(f"policy '{name}' needs a head: {name}:PATH_TO_CKPT, policy_ckpt=PATH or policy.{name}.ckpt=PATH")
    from models.heads import load_head

    bundle = load_head(Path(path))
    if pair is not None:
        bundle.check_pair(pair)
        bundle.head.to(pair.device)
    return bundle


def _call(make, extra: dict, what: str, hint: str = "") -> StopPolicy:
    """`make(**extra)`; a constructor that rejects its parameters (TypeError) is one user-error line."""
    try:
        return make(**extra)
    except TypeError as err:
        raise UserError(f"bad parameter for {what}: {err}{hint}") from None
