"""transformers' own assisted generation as a decode method: what a user would run instead of this repo.

`target.generate(assistant_model=draft)` with transformers' defaults (num_assistant_tokens=20, schedule "constant",
assistant_confidence_threshold=0.4: the assistant stops drafting when its top probability falls below 0.4), timed
in the same process and on the same prompts as every policy. A `StopPolicy` by its flags only (`external`:
transformers runs its own loop), so the runner calls `generate` instead of `decode.loop.speculative`.

Counters come from forward pre-hooks on the two models during the call: target calls (verifications; the first
one includes the prompt), draft calls (one per drafted token). Drafted = draft calls; accepted = new tokens − target
calls (each verification emits its accepted tokens plus one), exact except when max_new_tokens cuts the last round.
No per-round lengths or draft/target time split are visible from outside, so per-position acceptance and c are not
reported for this row.
"""

from __future__ import annotations

import copy

import torch

from decode.drafter import Drafter
from decode.loop import GenResult
from decode.policies import StopPolicy
from models.lm import Clock


class HFAssisted(StopPolicy):
    name = "hf_assisted"
    oracle = False
    approximate = False
    greedy_only = False
    external = True

    def __init__(self, pair, num_assistant_tokens: int = 20, schedule: str = "constant",
                 confidence_threshold: float = 0.4):
        self.pair = pair
        self.k, self.schedule, self.threshold = int(num_assistant_tokens), str(schedule), float(confidence_threshold)
        # own copy: the student and layer-subset drafts share modules (embeddings, layers) with the target, and
        # transformers' assistant bookkeeping must not touch the target's
        self.assistant = copy.deepcopy(pair.draft)
        gc = self.assistant.generation_config
        gc.num_assistant_tokens = self.k
        gc.num_assistant_tokens_schedule = self.schedule
        gc.assistant_confidence_threshold = self.threshold
        self._init_k = self.k

    def reset(self, **ctx) -> None:
        # the "heuristic" schedule keeps num_assistant_tokens across generate calls, like transformers does
        pass

    def describe(self) -> dict:
        return {"name": self.name, "num_assistant_tokens": self.k, "schedule": self.schedule,
                "confidence_threshold": self.threshold}

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 eos: set[int] | None = None, generator: torch.Generator | None = None) -> GenResult:
        pair = self.pair
        x = torch.tensor([prompt_ids], device=pair.device)
        counts = {"target": 0, "draft": 0}
        hooks = [pair.target.register_forward_pre_hook(lambda *a: counts.__setitem__("target", counts["target"] + 1)),
                 self.assistant.register_forward_pre_hook(lambda *a: counts.__setitem__("draft", counts["draft"] + 1))]
        sampling = bool(temperature and temperature > 0)
        kwargs = {"do_sample": False}
        if sampling:
            kwargs = {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": 0}
            if generator is not None:
                torch.manual_seed(generator.initial_seed())  # transformers samples from the global RNG
        clock = Clock(pair.device)
        try:
            t0 = clock()
            out = pair.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=self.assistant,
                                       max_new_tokens=max_new_tokens, eos_token_id=sorted(eos or []),
                                       pad_token_id=pair.tokenizer.pad_token_id, **kwargs)
            wall = clock() - t0
        finally:
            for h in hooks:
                h.remove()
        tokens = out[0, len(prompt_ids):].tolist()
        res = GenResult(tokens=tokens, wall_s=wall, target_calls=counts["target"], draft_calls=counts["draft"])
        res.drafted = counts["draft"]
        res.accepted = max(0, min(len(tokens) - counts["target"], res.drafted))
        return res


class HFAssistedDrafter(Drafter):
    """The drafter for `hf_assisted`: transformers runs the whole generation (`generate`), so decode.loop runs no
    rounds of its own."""

    name = "hf_assisted"

    def __init__(self, pair, policy):
        super().__init__(policy, max_len=getattr(policy, "k", 1))

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        return None if getattr(policy_cls, "external", False) else "only transformers' own assisted generation"

    def describe(self) -> dict:
        return self.policy.describe()

    def generate(self, prompt_ids, max_new_tokens, temperature, top_p, eos, generator):
        return self.policy.generate(prompt_ids, max_new_tokens, temperature, top_p, eos, generator)
