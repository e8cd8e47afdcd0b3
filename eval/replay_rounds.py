"""The decoder's rounds on a greedy trace (eval.replay): decode.loop's own `rounds`, with the trace standing in for
the target (`TraceVerifier`) and for the student (`TraceChain`); any other drafter that needs no draft LM (prompt
lookup, a user's) replays on the trace's prompt and target tokens as it decodes (`trace_drafter`)."""

from __future__ import annotations

from decode.drafter import Chain, Drafter, Sampling, Verdict
from decode.loop import GenResult, rounds
from decode.methods import Method
from decode.policies import StopPolicy
from eval.continuations import PLUS_TRACE_COLUMNS, Continuation
from models.features.signals import DraftStep
from utils.cli import UserError


class TraceChain(Drafter):
    """The draft of a greedy trace: drafts its rows t, t+1, … asking the real policy after each, as the student's
    chain asks it in decode (decode.lm_drafters.Student), with the context and last verification's statistics
    rebuilt from the trace for a policy that reads them."""

    name = "trace"

    def __init__(self, policy: StopPolicy, cont: Continuation, synthetic=None):
        super().__init__(policy)
        self.cont, self.synthetic = cont, synthetic
        self.want_ctx = bool(getattr(policy, "needs_context", False))
        self.want_vs = bool(getattr(policy, "needs_verify_stats", False))
        if (self.want_ctx or self.want_vs) and cont.prompt is None:
            raise UserError("this head reads the context / last verification, which these traces lack "
                            f"({', '.join(PLUS_TRACE_COLUMNS)}); regenerate them with python -m data_gen")

    def start(self, prompt_ids, s, lookahead=None) -> None:
        cont = self.cont
        self.policy.reset(lookahead=cont.target_path.tolist(), synthetic=self.synthetic)
        self.ctx = list(cont.prompt) if self.want_ctx else None
        self.vstats, self.t = None, 0

    def propose(self, budget: int, res) -> Chain:
        cont, t, rnd = self.cont, self.t, Chain([], source=self)
        if cont.rows is not None and res.target_calls == 0:
            return rnd  # EAGLE-3's first round (decode.eagle3): nothing to read before the target's prefill
        for j in range(min(self.max_len, budget)):
            i = cont.row(t, j)
            if i is None:  # an eagle_chain trace records `steps` tokens per round: a longer one ends there
                break
            rnd.tokens.append(int(cont.draft_token[i]))
            step = DraftStep(probs=cont.topk[i], token=int(cont.draft_token[i]),
                             hidden=None if cont.hidden is None else cont.hidden[i], position_in_round=j, position=t + j,
                             _topk=cont.topk[i], _entropy=cont.entropy[i], context=self.ctx, verify=self.vstats)
            if self.policy.should_stop(step):
                rnd.stopped = True
                break
        return rnd

    def commit(self, v: Verdict, res) -> None:
        k, n, t = v.drafted, len(v.kept), self.t
        if getattr(v.proposal, "source", None) is self:  # not a round another part of a composite proposed
            self.policy.observe(k, n)
            if self.want_vs:
                self.vstats = self.cont.verify_stats(t, k, n)
        if self.ctx is not None:
            self.ctx.extend(int(x) for x in self.cont.context_token[t : t + n + 1])
        self.t = t + n + 1


class TraceVerifier:
    """The target of a greedy trace: a round keeps the leading candidates equal to the target's greedy tokens, then
    the target's own token (decode.loop's Verifier under greedy, read off the trace). Any chain drafter replays on
    it; one that needs no draft LM (prompt lookup) replays exactly, the trace's draft only up to its first
    rejection (the module docstring)."""

    def __init__(self, cont: Continuation):
        self.cont, self.t = cont, 0

    def verify(self, proposal, s, res) -> Verdict:
        target, t, k = self.cont.target_path, self.t, len(proposal.tokens)
        n = 0
        while n < k and int(target[t + n]) == proposal.tokens[n]:
            n += 1
        res.target_calls += 1
        self.t = t + n + 1
        kept = [int(x) for x in target[t : t + n]]
        return Verdict(list(range(n)), kept, int(target[t + n]), k, None, None, None,
                       proposal=proposal)


def replay_one(policy: StopPolicy, cont: Continuation, synthetic=None, drafter=None) -> list[tuple[int, int]]:
    """The rounds (drafted k, accepted n) decode.loop.speculative would run on this continuation: decode.loop's own
    `rounds`, with the trace standing in for the draft (`TraceChain`) and the target (`TraceVerifier`).

    Same round structure as the loop: at most min(max_len, tokens left − 1) drafted tokens, the token that makes the
    policy stop is drafted and verified, the target adds one token per round (correction or bonus). A policy that
    reads the context (prompt + committed output) or the last verification's statistics (disco_plus heads) gets
    them as the loop builds them, from the trace's prompt, context tokens and target statistics. `drafter`: another
    drafter to replay (`trace_drafter`), on the trace's prompt."""
    drafter = drafter or TraceChain(policy, cont, synthetic)
    drafter.start([] if cont.prompt is None else [int(x) for x in cont.prompt], Sampling(),
                  lookahead=cont.target_path.tolist())
    res = rounds(drafter, TraceVerifier(cont), Sampling(), len(cont.target_path), GenResult(tokens=[]))
    return res.rounds


class TracePair:
    """What a drafter built for the replay reads of its pair, from a trace manifest: no model is loaded."""

    def __init__(self, manifest: dict):
        self.pair_id, self.vocab_size = manifest.get("pair_id"), int(manifest.get("vocab_size") or 0)
        self.eos_ids: set[int] = set()


def trace_drafter(method: Method, policy: StopPolicy, cont: Continuation, manifest: dict):
    """The drafter a method replays with on one continuation: None for the traces' own draft (`TraceChain`, the
    default), else the method's drafter from its yaml on a `TracePair`, the trace's draft standing in for the model
    draft inside a composite (student+lookup). One user-error line for a drafter that needs a model."""
    name = method.drafter
    if name in (None, manifest.get("drafter", "student")):
        return None
    if cont.prompt is None:
        raise UserError(f"drafter '{name}' replays from the prompt, which these traces lack; regenerate them with "
                        "python -m data_gen")
    from decode.drafter import build_drafter
    from utils import discover

    params = dict(method.drafter_params or {})
    if (discover.load("drafter", name) or {}).get("inner", "") == manifest.get("drafter", "student"):
        params["model"] = TraceChain(policy, cont)  # a composite around the traces' own draft (eagle3+lookup)
    try:
        return build_drafter(name, TracePair(manifest), policy, params)
    except (AttributeError, TypeError) as err:
        raise UserError(f"drafter '{name}' cannot be replayed on traces (it needs a model: {err})") from None
