"""Drafters: what proposes a round's candidate tokens, and the one verification of what they propose.

A drafter is shaped like transformers' candidate generator (`get_candidates` / `update_candidate_strategy`):
- `start(prompt_ids, sampling, lookahead=None)` once per prompt: fresh caches, its stop policy reset;
- `propose(budget, res) -> Proposal`: a `Chain` or a `TreeProposal` no deeper than `budget` tokens, with the
  per-token signals its stop policy or tree builder read; drafting and policy time go to `res`;
- `commit(verdict, res)`: the verification's outcome (`Verdict`: the accepted path, the target's next token, its
  logits, and the target's hidden states at the `layers` the drafter names, at the verified positions). The
  drafter keeps or rolls back its own caches and adapts its own state there.
decode.loop runs rounds of propose → `Proposal.verify` (one target pass, the acceptance rule, the target cache cut
to the accepted path) → commit, and knows nothing else about a drafter. A stop policy decides only where a chain
stops, a tree builder only a tree's shape: both are handed to the drafter that asks them.

A drafter is found by name: `conf/drafter/<name>.yaml` on Hydra's config search path, whose `_target_` names the
class and whose other keys its parameters, as a stop policy is found (decode.policies). So a new kind of draft is one
`Drafter` subclass and one yaml. A class says which stop policies it runs with (`runs(policy_cls)`) and which drafter
runs a policy it hands on (`delegate`: the student hands tree builders to `tree`, SPRINTER's verifier to `sprinter`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode.tree import verify as tree_verify
from decode.verify import greedy_verify, sample_verify, sprinter_verify
from models.distributions import draft_probs, greedy_ids, tvd
from models.lm import target_pass
from utils.cli import UserError


@dataclass(frozen=True)
class Sampling:
    """How a generation samples (shared by the drafter's draws and the verification), and its end-of-sequence ids
    (a chain stops drafting after one)."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    eos: frozenset = frozenset()

    @property
    def greedy(self) -> bool:
        return not (self.temperature and self.temperature > 0)

    def draw(self, z: torch.Tensor, want_q: bool, ids: torch.Tensor | None = None,
             vocab: int | None = None) -> tuple[torch.Tensor | None, int]:
        """(q, token) from a draft's logits z (V,): the argmax under greedy (q only when `want_q`), else a sample
        from q at this temperature and top-p — the one draw every model drafter makes. With `ids` (sorted) z scores
        only those tokens of a `vocab`-wide vocabulary (a reduced head): the same law as −inf logits elsewhere
        (q is 0 there; the first maximum is the same token), without a softmax over the whole vocabulary."""
        if self.greedy:
            q, tok = (draft_probs(z, 0.0) if want_q else None), int(greedy_ids(z))
        else:
            q = draft_probs(z, self.temperature, self.top_p)
            tok = int(torch.multinomial(q, 1, generator=self.generator))
        if ids is None:
            return q, tok
        return (None if q is None else q.new_zeros(vocab).index_copy_(0, ids, q)), int(ids[tok])


@dataclass
class Verdict:
    """One verification: `path` indexes the accepted candidates in the proposal (a chain: 0..n−1; a tree: node
    ids root to leaf), `kept` their tokens, `next` the target's token after them. `drafted`: candidates the target
    checked. `p`: the target's distributions at the chain's k+1 rows (None under greedy, which needs none);
    `logits`: the target's logits at the verified rows; `z_next`: the row `next` came from. `hidden`:
    (len(layers), m, d) target hidden states at the pending tokens and the accepted path, for the layers the
    drafter named (None when it named none)."""

    path: list[int]
    kept: list[int]
    next: int
    drafted: int
    p: torch.Tensor | None
    logits: torch.Tensor
    z_next: torch.Tensor
    hidden: torch.Tensor | None = None
    proposal: object = None


class Proposal:
    """A round's candidates. `verify` runs the target once over the pending token(s) and the candidates, applies
    the acceptance rule, and leaves the target cache holding exactly the committed text and the accepted path."""

    tokens: list[int]

    def verify(self, target, tcache, t_pending: list[int], s: Sampling, res, layers=()) -> Verdict:
        raise NotImplementedError


@dataclass
class Chain(Proposal):
    """A chain x_1..x_k drafted one after another. `qs`: the distribution each token was drawn from (sampling
    verification reads them; a deterministic drafter gives point masses); empty under greedy when nothing asked for
    them. `stopped`: the stop policy ended the round (SPRINTER: its verifier rejected the last token)."""

    tokens: list[int]
    qs: list = None
    stopped: bool = False
    source: object = None  # the drafter that proposed it (a composite drafter's parts tell theirs apart)
    approximate = False  # a class attribute, not a field: ApproxChain's verification keeps tokens unchecked

    def __post_init__(self):
        self.qs = [] if self.qs is None else self.qs

    def verify(self, target, tcache, t_pending, s, res, layers=()) -> Verdict:
        k = len(self.tokens)
        logits, taps = target_pass(target, t_pending + self.tokens, tcache, k + 1, layers)
        res.target_calls += 1
        p = None if s.greedy and not self.approximate else draft_probs(logits, s.temperature, s.top_p)
        n, nxt = self.accept(logits, p, s, res)
        if k - n > 0:
            tcache.crop(-(k - n))
        hidden = None if taps is None else taps[:, : len(t_pending) + n]
        return Verdict(list(range(n)), self.tokens[:n], nxt, k, p, logits, logits[n], hidden, self)

    def accept(self, logits, p, s: Sampling, res) -> tuple[int, int]:
        """Exact verification (lossless): greedy, or Leviathan et al.'s rejection sampling."""
        if p is None:
            return greedy_verify(greedy_ids(logits), torch.tensor(self.tokens, dtype=torch.long))
        q = torch.stack(self.qs) if self.tokens else p[:0]
        return sample_verify(p, q, torch.tensor(self.tokens, dtype=torch.long, device=p.device), s.generator)


@dataclass
class ApproxChain(Chain):
    """SPRINTER's approximate verification: tokens its verifier accepted are kept unchecked (decode.verify)."""

    approximate = True

    def accept(self, logits, p, s: Sampling, res) -> tuple[int, int]:
        k = len(self.tokens)
        q = torch.stack(self.qs) if k else p[:0]
        dt = torch.tensor(self.tokens, dtype=torch.long, device=p.device)
        n, nxt = sprinter_verify(p, q, dt, self.stopped, s.greedy, s.generator)
        unchecked = k - 1 if (self.stopped and k) else k
        if unchecked:
            res.unchecked += unchecked
            res.tvd_sum += float(tvd(p[:unchecked], q[:unchecked]).sum())
        return n, nxt


@dataclass
class TreeProposal(Proposal):
    """A token tree (models.tree.Tree) grown by the draft after `prefix_len` committed tokens; `nodes` are the ones
    the builder selected for verification (closed under ancestors). Verified in one tree-attention pass (decode.tree)."""

    tree: object
    prefix_len: int
    nodes: list[int]

    @property
    def tokens(self) -> list[int]:
        return [self.tree.tokens[i] for i in self.nodes]

    def verify(self, target, tcache, t_pending, s, res, layers=()) -> Verdict:
        path, nxt, z, rows, logits, taps = tree_verify(target, tcache, t_pending, self.tree, self.nodes, s, res,
                                                       layers)
        target.keep(tcache, list(range(self.prefix_len)) + [self.tree.tpos[i] for i in path])
        hidden = None if taps is None else taps[:, list(range(len(t_pending))) + [len(t_pending) + r for r in rows]]
        return Verdict(path, [self.tree.tokens[i] for i in path], nxt, len(self.nodes), None, logits, z, hidden, self)


class Drafter:
    """The interface (module docstring). `layers`: target hidden-state indices (models.lm) its commit reads.
    `max_len`: the most tokens it drafts in a round (its stop policy's cap). `policy`: the stop policy or tree
    builder it asks (None for one that needs none). `profile_of(profile)`: the cost profile its rounds are priced
    on (the student's: the pair's measured one)."""

    name = "base"
    layers: tuple[int, ...] = ()
    greedy_only = False
    params_of: str | None = None  # a drafter it runs for (by `delegate`) whose `drafter.<name>.*` parameters it takes
    heads_from = "student"  # whose traces a stop head it runs must have been trained on (HeadBundle.drafter)

    def __init__(self, policy=None, max_len: int | None = None):
        self.policy = policy
        self.max_len = int(max_len if max_len is not None else getattr(policy, "max_len", 8))

    # -- what it runs with ----------------------------------------------------------------------------------------
    @classmethod
    def runs(cls, policy_cls) -> str | None:
        """Why this drafter cannot run with a policy of `policy_cls` (None: it can)."""
        return None

    @classmethod
    def delegate(cls, policy_cls) -> str | None:
        """The drafter (by name) that runs `policy_cls` in this drafter's place; None: this one."""
        return None

    def profile_of(self, profile):
        return profile

    def describe(self) -> dict:
        return {"name": self.name}

    # -- a generation ---------------------------------------------------------------------------------------------
    def start(self, prompt_ids: list[int], s: Sampling, lookahead=None) -> None:
        raise NotImplementedError

    def propose(self, budget: int, res) -> Proposal:
        raise NotImplementedError

    def commit(self, verdict: Verdict, res) -> None:
        raise NotImplementedError

    def generate(self, prompt_ids, max_new_tokens, temperature, top_p, eos, generator):
        """A drafter that runs its own loop (transformers' assisted generation) returns its GenResult here; None:
        decode.loop runs the rounds."""
        return None


# ------------------------------------------------------------------------------------------- finding and building


def drafter_class(name: str, cfg=None) -> type[Drafter] | None:
    """The class of conf/drafter/<name>.yaml on the search path (None: no such yaml)."""
    from utils import discover

    path = discover.find("drafter", name, cfg)
    if path is None:
        return None
    return discover.target_class(discover.read(path).get("_target_"), Drafter,
                                 f"drafter '{name}' ({discover.shown(path)})")


def known_drafters(cfg=None) -> list[str]:
    from utils import discover

    return discover.names("drafter", cfg)


def check_drafter(name: str, cfg=None) -> type[Drafter]:
    cls = drafter_class(name, cfg)
    if cls is None:
        raise UserError(f"unknown drafter '{name}'; known: {', '.join(known_drafters(cfg))} "
                        "(conf/drafter/<name>.yaml; add one with hydra.searchpath=[file:///DIR])")
    return cls


def build_drafter(name: str, pair, policy=None, params: dict | None = None, cfg=None) -> Drafter:
    """The drafter `name` (its yaml's parameters, then `params` over them) on `pair`, asking `policy`."""
    from hydra.utils import instantiate

    from utils import discover

    check_drafter(name, cfg)
    conf = {**(discover.load("drafter", name, cfg) or {}), **dict(params or {})}
    make = instantiate(conf, _partial_=True, _convert_="all")  # the pair and policy are objects, not config values
    try:
        drafter = make(pair=pair, policy=policy)
    except TypeError as err:
        raise UserError(f"bad parameter for drafter {name}: {err}; see conf/drafter/{name}.yaml") from None
    bundle = getattr(policy, "bundle", None)
    trained_on = getattr(bundle, "drafter", drafter.heads_from)
    if bundle is not None and trained_on != drafter.heads_from:
        raise UserError(f"head {bundle.path} was trained on {trained_on}'s traces; drafter {name} drafts with "
                        f"{drafter.heads_from}'s (train a head on its traces: trace=eagle_chain or eagle_tree for eagle3)")
    return drafter


def for_policy(name: str, pair, policy, params: dict | None = None, cfg=None) -> Drafter:
    """Drafter `name` asking `policy` — or the drafter it hands a policy of that kind to (`delegate`: the student
    hands a tree builder to `tree`); one error line when the two do not go together."""
    cls = check_drafter(name, cfg)
    runner = cls.delegate(type(policy)) or name
    runner_cls = check_drafter(runner, cfg)
    why = runner_cls.runs(type(policy))
    if why:
        raise UserError(f"drafter '{name}' does not run policy '{getattr(policy, 'name', policy)}': {why}")
    own = runner == name or runner_cls.params_of == name  # EAGLE-3's trees take its weights
    return build_drafter(runner, pair, policy, params if own else None, cfg)


def runner_of(name: str, policy_cls, cfg=None, head: str | None = None) -> tuple[str | None, str | None]:
    """(the drafter that runs `policy_cls` for drafter `name`, None) or (None, why it cannot) — also when `head` (a
    learned policy's checkpoint) was trained on another drafter's traces."""
    runner = check_drafter(name, cfg).delegate(policy_cls) or name
    runner_cls = check_drafter(runner, cfg)
    why = runner_cls.runs(policy_cls)
    if not why and head and policy_cls.learned:
        from models.heads import load_head

        trained_on = load_head(head).drafter
        if trained_on != runner_cls.heads_from:
            why = f"its head was trained on {trained_on}'s traces, {runner} drafts with {runner_cls.heads_from}'s"
    return (None, why) if why else (runner, None)
