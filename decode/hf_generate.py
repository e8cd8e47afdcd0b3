"""Our stop policies and trained stop heads inside transformers' own `generate()` (issue 28): a drop-in stop rule.

    head = load_head("models/weights/heads/disco_plus_copy_token_mbpp.ckpt")           # models.heads
    hook = stop_policy_generator(head, draft, pair=pair)    # or "svip", Constant(k=3), ...; other models: rule="threshold"
    out = target.generate(ids, assistant_model=draft, custom_generate=hook, do_sample=False, max_new_tokens=128)

**Why `custom_generate` and not a bare `CandidateGenerator`.** transformers 5.24 has two extension points for
assisted generation. A `CandidateGenerator` subclass (candidate_generator.py: `get_candidates` per round,
`update_candidate_strategy` after each verification) is the right shape for a stop rule, but `generate()` has no
argument that takes one: `_assisted_decoding` always builds its generator in the private `_get_candidate_generator`,
choosing among the built-in classes from generation-config flags. `custom_generate=<callable>` is the public,
documented hook: `generate()` does all its usual preparation (generation config, logits processors, stopping criteria,
EOS and length, the KV cache) and then calls the callable as the decoding loop. So the hook returned here is a
`custom_generate` callable that runs transformers' own assisted loop (`_assisted_decoding`) unchanged — target
verification, cache rollback, EOS/length cuts, speculative sampling — with `PolicyCandidateGenerator` in place of
the default generator. The one private seam: `_get_candidate_generator` is overridden on the target *instance* for
the duration of the call and removed after. The alternative, a decoding loop of our own inside the callable, would
be a second copy of decode/loop.py, not "our stop rule in the engine you use".

**What the policy sees.** The generator drafts with transformers' own draft loop (`assistant_model.generate`, its cache
and masks) plus one stopping criterion that builds, per drafted token, the `models.features.DraftStep` decode/loop.py
builds (q from the draft's scores, token, position in round and in the continuation, the context for heads that read
it, the draft's last hidden state from a pre-hook on its output layer for heads that read it, the last verification's
statistics) and asks `policy.should_stop(step)`; `update_candidate_strategy` then hands the policy
`observe(drafted, accepted)` and computes the verification statistics from the target logits transformers passes
there, with decode/loop.py's own function. Heads therefore see the features they were trained on (a test checks the
rows equal decode's). transformers' own rules are off: no confidence threshold, no heuristic schedule;
`policy.max_len` caps a round.

**What works.** Every exact stop policy (`works()`, read from the classes' flags), greedy and sampling. Refused
with one UserError (`REFUSED`, by flag): `sprinter` (approximate verification: transformers checks every drafted
token), `oracle` (needs the target-only output in advance), `hf_assisted` (it *is* transformers' rule), tree builders. Rules that read the measured cost profile (expected_value, and
heads whose stored rule is expected_value) need `profile=` (a models.cost.CostProfile, or a function returning one),
or `pair=` to measure it, or `rule="threshold"`.

**Exactness.** Greedy output equals plain greedy `target.generate()` token for token (in low precision up to
near-tie flips between a 1-token step and a multi-token verify pass, as for any assisted generation). Sampling is
exact in distribution (transformers' speculative sampling; the stop decision reads only the draft's side) but does
not reproduce plain sampling's random stream, so only greedy is checked token for token.

transformers 5.24 passes a custom_generate callable neither `assistant_model` (so the hook carries the draft;
`assistant_model=` in generate() only documents intent and must be the same model) nor `streamer` (dropped). One hook
may serve many generate() calls, one at a time (the instance override is not thread-safe).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from decode.lm_drafters import verify_stats as _verify_stats
from decode.learned import Learned
from decode.policies import build_policy, known_policies, parse_spec, policy_class, policy_config
from models.distributions import draft_probs
from models.features.signals import DraftStep
from models.heads import HeadBundle, load_head
from utils.cli import UserError

REFUSED = {
    "approximate": "needs approximate verification (SPRINTER keeps tokens the target never checks), and transformers' "
                   "generate() verifies every drafted token",
    "oracle": "needs the target-only output in advance",
    "external": "is transformers' own assisted generation already: pass its settings to generate() instead",
    "tree": "builds token trees, and transformers' assisted generation verifies one chain; use python -m decode",
}



def works() -> str:
    """The policies that run inside generate(), read from their classes' flags (none of REFUSED's), for messages."""
    names = []
    for name in known_policies():
        try:
            cls = policy_class(name)
        except UserError:  # a user's broken yaml is reported where it is used, not here
            continue
        if cls is not None and not any(getattr(cls, flag, False) for flag in REFUSED):
            names.append(f"{name}:PATH (a head .ckpt or HeadBundle too)" if cls.learned else name)
    return ", ".join(names)


# ------------------------------------------------------------------------------------------------- the generator


class _PolicyStop(StoppingCriteria):
    """The draft loop's stopping criterion: one `policy.should_stop` per drafted token (transformers calls it after
    appending the token, with the scores it was drafted from; stopping keeps the token, as in decode/loop.py)."""

    def __init__(self, gen: "PolicyCandidateGenerator"):
        self.gen = gen

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.gen.draft_step(input_ids, scores), dtype=torch.bool,
                          device=input_ids.device)


class PolicyCandidateGenerator(AssistedCandidateGenerator):
    """transformers' assisted candidate generator with the draft length decided by a stop policy (module docstring).

    Built by transformers once per generate() call (through the hook), so per-call state lives here: the prompt
    length, the round's start, the committed context, the drafted q's of the round and the last verification."""

    def __init__(self, hook: "StopPolicyHook", **kwargs):
        super().__init__(**kwargs)
        self.hook, self.policy = hook, hook.policy
        # transformers' own early stop off; num_assistant_tokens is left alone (only `_calculate_new_tokens` reads
        # it here), so the heuristic-schedule write-back at the end of generate() leaves the draft's config as it was
        self.generation_config.assistant_confidence_threshold = 0.0
        self.criteria = StoppingCriteriaList([_PolicyStop(self)])
        pol = self.policy
        self.want_vs = bool(getattr(pol, "needs_verify_stats", False))
        self.want_q = bool(getattr(pol, "needs_probs", True)) or self.want_vs
        self.want_h = bool(getattr(pol, "needs_hidden", False))
        self.prompt_len = self.round_start = int(kwargs["input_ids"].shape[-1])
        self.ctx: list[int] | None = [] if getattr(pol, "needs_context", False) else None
        self.vstats = None
        self.qs: list[torch.Tensor] = []  # the round's q on the draft's support (verification statistics)

    def get_candidates(self, input_ids, **kwargs):
        self.round_start = int(input_ids.shape[-1])
        if self.ctx is not None:  # prompt + committed output, extended by what the last round committed
            self.ctx.extend(input_ids[0, len(self.ctx):].tolist())
        self.qs = []
        return super().get_candidates(input_ids, **kwargs)

    def _calculate_new_tokens(self, input_ids):
        """transformers' round cap (the token budget, min_new_tokens) with the policy's max_len as the draft cap."""
        saved, self.num_assistant_tokens = self.num_assistant_tokens, self.policy.max_len
        try:
            return super()._calculate_new_tokens(input_ids)
        finally:
            self.num_assistant_tokens = saved

    def _prepare_generation_args(self, input_ids, min_new_tokens, max_new_tokens):
        return {**super()._prepare_generation_args(input_ids, min_new_tokens, max_new_tokens),
                "stopping_criteria": self.criteria}

    def draft_step(self, input_ids, scores) -> bool:
        """The DraftStep of the token just drafted (decode/loop.py's fields) → the policy's stop decision."""
        cur = int(input_ids.shape[-1])
        q = draft_probs(scores[-1][0]) if self.want_q else None  # softmax of the (processed) draft logits, float32
        step = DraftStep(probs=q, token=int(input_ids[0, -1]),
                         hidden=self.hook.hidden[0, -1] if self.want_h else None,
                         position_in_round=cur - self.round_start - 1, position=cur - self.prompt_len - 1,
                         context=self.ctx, verify=self.vstats, support=self.hook.support)
        stop = bool(self.policy.should_stop(step))
        if self.want_vs:
            self.qs.append(step.on_support())
        return stop

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """After a verification: `scores` are the target's (processed) logits at the k drafted positions + 1."""
        k, n = int(scores.shape[1]) - 1, int(num_matches)
        if self.want_vs:  # decode/loop.py's statistics, from logits (p = softmax) and the round's q on the support
            self.vstats = _verify_stats(None, scores[0].float(), self.qs, self.hook.support, k, n)
        self.policy.observe(k, n)
        self.hook.rounds.append((k, n))


# ------------------------------------------------------------------------------------------------------ the hook


class StopPolicyHook:
    """A `custom_generate` callable: transformers' assisted generation with `policy` deciding each draft length.

    Make it with `stop_policy_generator`. After each generate() call `rounds` holds that call's (drafted, accepted)
    per verification, so drafted = Σk, target calls = len(rounds), mean accepted length = new tokens / len(rounds).
    """

    def __init__(self, policy, draft):
        self.policy, self.draft = policy, draft
        head = draft.get_output_embeddings()
        # a reduced-vocabulary draft (models.lm_head.SubsetHead) gives mass only to these ids: features read q there
        ids = getattr(head, "ids", None)
        self.support = ids if isinstance(ids, torch.Tensor) else None
        self.rounds: list[tuple[int, int]] = []
        self.hidden: torch.Tensor | None = None  # the draft's last output-layer input (heads that read h)

    def _keep_hidden(self, module, args):
        self.hidden = args[0]

    def __call__(self, model, input_ids, logits_processor, stopping_criteria, generation_config,
                 inputs_tensor=None, **model_kwargs):
        if int(getattr(generation_config, "num_beams", 1) or 1) > 1:
            raise UserError("a stop policy drafts for one sequence; generate() with num_beams=1")
        self.rounds, self.hidden = [], None
        self.policy.reset()

        def candidate_generator(generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
            return PolicyCandidateGenerator(self, input_ids=input_ids, assistant_model=self.draft,
                                            generation_config=generation_config, model_kwargs=model_kwargs,
                                            inputs_tensor=inputs_tensor, logits_processor=logits_processor)

        # heads that read h: the input of the draft's output layer, i.e. the final-norm hidden state that produced
        # the logits (a layer shared with the target also fires on verification; the criterion reads it right after
        # a draft step, so it always sees the draft's)
        handle = (self.draft.get_output_embeddings().register_forward_pre_hook(self._keep_hidden)
                  if getattr(self.policy, "needs_hidden", False) else None)
        model._get_candidate_generator = candidate_generator  # this call only (module docstring)
        try:
            return type(model)._assisted_decoding(
                model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, inputs_tensor=inputs_tensor, assistant_model=self.draft,
                **model_kwargs)
        finally:
            del model._get_candidate_generator
            if handle is not None:
                handle.remove()


# ------------------------------------------------------------------------------------------------ building one


def stop_policy_generator(policy, draft, *, profile=None, pair=None, tokenizer=None, **params) -> StopPolicyHook:
    """The `custom_generate` hook for `target.generate(..., assistant_model=draft, custom_generate=hook)`.

    `policy`: a stop policy object (decode.policies), a head (`models.heads.load_head(...)`), a head checkpoint path,
    or a policy spec (`"svip"`, `"learned:PATH"`); `params` go to its constructor (conf/policy/<name>.yaml: `k=3`,
    `threshold=0.4`, `rule="threshold"`). `profile`: the cost profile (models.cost) for expected-value rules, or a
    function returning it (called only when needed). `pair` (models.pair.Pair) / `tokenizer`: check a head against
    the pair / tokenizer it was trained for. Anything transformers' hook cannot give the policy is one UserError.
    """
    _check_transformers()
    pol = resolve_policy(policy, draft, profile=profile, pair=pair, tokenizer=tokenizer, **params)
    return StopPolicyHook(pol, draft)


def generate(target, draft, input_ids, policy, *, profile=None, pair=None, tokenizer=None, params: dict | None = None,
             **generate_kwargs):
    """`target.generate(input_ids, assistant_model=draft, **generate_kwargs)` with `policy` deciding draft lengths
    (`stop_policy_generator` for the arguments); returns what generate() returns."""
    hook = stop_policy_generator(policy, draft, profile=profile, pair=pair, tokenizer=tokenizer, **(params or {}))
    return target.generate(input_ids, assistant_model=draft, custom_generate=hook, **generate_kwargs)


def resolve_policy(policy, draft, *, profile=None, pair=None, tokenizer=None, **params):
    """A checked stop policy object from whatever `stop_policy_generator` accepts."""
    wrap = Learned
    if isinstance(policy, (str, Path)):
        policy, wrap = _from_spec(str(policy), profile, pair, params)
        params = params if wrap is not None else {}
    if isinstance(policy, HeadBundle):
        policy, params = _learned(policy, wrap, draft, profile, pair, tokenizer, params), {}
    elif getattr(policy, "bundle", None) is not None:  # a learned policy built elsewhere: check its head here
        _check_head(policy.bundle, draft, pair, tokenizer)
    if params:
        raise UserError(f"parameters {sorted(params)} go to a policy built here (a name, head or checkpoint), not to "
                        f"an already built {type(policy).__name__}")
    if not callable(getattr(policy, "should_stop", None)) or not hasattr(policy, "max_len"):
        raise UserError(f"policy must be a stop policy (decode.policies), a head (models.heads.load_head), a head "
                        f".ckpt path or a policy name; got {type(policy).__name__}. Inside generate() these work: {works()}")
    for flag, why in REFUSED.items():
        if getattr(policy, flag, False):
            _refuse(getattr(policy, "name", type(policy).__name__), why)
    if getattr(policy, "needs_hidden", False) and draft.get_output_embeddings() is None:
        _refuse(policy.name, f"reads the draft's hidden state, taken at its output layer, which "
                             f"{type(draft).__name__} does not expose (get_output_embeddings() is None)")
    return policy


def _from_spec(text: str, profile, pair, params: dict):
    """(a head and the learned policy class to wrap it in) or (a built policy, None), from a checkpoint path or a
    spec (`svip`, `learned:PATH`); what a policy is comes from its class's flags (decode.policies), not its name."""
    if Path(text).suffix == ".ckpt" or Path(text).is_file():
        return load_head(Path(text)), Learned
    name, path = parse_spec(text)  # an unknown name: one line listing the known ones
    cls = policy_class(name) if name != "target" else None
    if cls is None:
        _refuse(name, "is target-only decoding, not a stop rule")
    for flag, why in REFUSED.items():
        if getattr(cls, flag, False):
            _refuse(name, why)
    if cls.learned:
        if not path:
            raise UserError(f"policy '{name}' needs its head: {name}:PATH, or pass the .ckpt path or load_head(PATH)")
        return load_head(Path(path)), cls
    params = {**_defaults(name), **params}
    prof = _profile(profile, pair, cls.wants_profile(params), f"policy {name}")
    return build_policy(text, params, pair=pair, profile=prof), None


def _defaults(name: str) -> dict:
    """conf/policy/<name>.yaml's parameters, the defaults `python -m decode` builds the policy with."""
    conf = policy_config(name) or {}
    return {k: v for k, v in conf.items() if not k.startswith("_") and k != "ckpt"}


def _learned(bundle: HeadBundle, cls, draft, profile, pair, tokenizer, params: dict):
    """A learned policy (decode.learned.Learned) on a checked head, with the cost profile when its rule reads one."""
    _check_head(bundle, draft, pair, tokenizer)
    kw = {**_defaults(cls.name), **params}
    if cls.wants_profile(kw, bundle):
        what = f"head {bundle.path or bundle.kind} (stop rule expected_value)"
        kw["profile"] = _profile(profile, pair, True, what, hint=", or rule='threshold' for its stored threshold")
    bundle.head.to(next(draft.parameters()).device)  # features stay on the draft's device: no copy per drafted token
    try:
        return cls(bundle, **kw)
    except TypeError as err:
        raise UserError(f"bad parameter for a learned head: {err}; see conf/policy/learned.yaml") from None


def _profile(profile, pair, wanted: bool, what: str, hint: str = ""):
    """The cost profile when the rule reads it: given, made by a given function, or measured for `pair`."""
    if not wanted:
        return None
    if callable(profile):
        profile = profile()
    if profile is None and pair is not None:
        from models.profiling import get_profile

        profile = get_profile(pair)
    if profile is None:
        raise UserError(f"{what} reads the measured cost profile: pass profile=models.profiling.get_profile(pair) (or a "
                        f"CostProfile from python -m decode.profile) or pair=PAIR{hint}")
    return profile


def _check_head(bundle: HeadBundle, draft, pair, tokenizer) -> None:
    """Refuse a head trained for another pair / tokenizer, or one reading hidden states of another size."""
    where = f" {bundle.path}" if bundle.path else ""
    if pair is not None:
        bundle.check_pair(pair)
    if tokenizer is not None:
        from models.pair import tokenizer_hash

        got = tokenizer_hash(tokenizer)
        if got != bundle.tokenizer_hash:
            raise UserError(f"head{where} was trained on pair {bundle.pair_id} (tokenizer "
                            f"{bundle.tokenizer_hash}) but this tokenizer hashes to {got}; train a head for these models")
    if bundle.spec.reads_hidden:
        d = int(getattr(draft.config, "hidden_size", -1))
        if d != int(bundle.spec.d):
            raise UserError(f"head{where} reads draft hidden states of size {bundle.spec.d} but this "
                            f"draft's hidden size is {d}")


def _refuse(name: str, why: str):
    raise UserError(f"policy '{name}' cannot run inside transformers' generate(): it {why}. These work: {works()}")


def _check_transformers() -> None:
    """The hook runs transformers' `_assisted_decoding` with its generator swapped in (module docstring): refuse a
    transformers without that seam in one line instead of a stack trace mid-generation."""
    import transformers

    missing = [m for m in ("_assisted_decoding", "_get_candidate_generator") if not hasattr(GenerationMixin, m)]
    if missing:
        raise UserError(f"transformers {transformers.__version__} has no GenerationMixin.{missing[0]}; this hook was "
                        "written against transformers 5.24 (pip install 'transformers>=5.20,<6')")


__all__ = ["StopPolicyHook", "PolicyCandidateGenerator", "stop_policy_generator", "generate", "resolve_policy", "works"]
