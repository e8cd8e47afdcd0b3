"""decode/hf_generate.py on the tiny pair: a trained head and training-free policies inside transformers' generate()
give plain greedy generate()'s tokens; the policy's decisions set the draft lengths (the same rounds, and for heads
the same feature rows, as decode/loop.py); what the hook cannot run is one UserError line; the bench runs end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from decode.hf_generate import generate, resolve_policy, stop_policy_generator
from decode.loop import speculative
from decode.learned import Learned, Sprinter
from decode.policies import StopPolicy, build_policy
from decode.rules import Constant
from models.features.spec import FeatureSpec
from models.features.text import pack_classes, token_classes
from models.heads import HeadBundle, build_head
from utils.cli import CONF_DIR, UserError

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "x = [i * i for i in range(10)]\nprint("]
MAX_NEW = 32

pytestmark = pytest.mark.usefixtures("one_thread")


def ids_of(pair, text):
    return pair.tokenizer.encode(text, add_special_tokens=False)


def gen_kwargs(pair, x, max_new=MAX_NEW, **kw):
    return {"attention_mask": torch.ones_like(x), "do_sample": False, "max_new_tokens": max_new,
            "pad_token_id": pair.tokenizer.pad_token_id, "eos_token_id": pair.tokenizer.eos_token_id, **kw}


_PLAIN: dict = {}


def plain(pair, ids, max_new=MAX_NEW):
    """Plain greedy `target.generate()` (no assistant): the reference every output must equal (memoised)."""
    key = (id(pair), tuple(ids), max_new)
    if key not in _PLAIN:
        x = torch.tensor([ids])
        _PLAIN[key] = pair.target.generate(x, **gen_kwargs(pair, x, max_new))[0, len(ids):].tolist()
    return _PLAIN[key]


def hooked(pair, hook, ids, max_new=MAX_NEW, **kw):
    x = torch.tensor([ids])
    out = pair.target.generate(x, assistant_model=hook.draft, custom_generate=hook, **gen_kwargs(pair, x, max_new, **kw))
    return out[0, len(ids):].tolist()


def random_head(pair, kind: str, spec: FeatureSpec, threshold: float = 0.5, seed: int = 0) -> HeadBundle:
    """A head with random weights everywhere (a fresh disco_plus is max q exactly): varied stop decisions."""
    torch.manual_seed(seed)
    head = build_head(kind, spec).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return HeadBundle(head=head, kind=kind, spec=spec, labels={"name": "greedy_match"}, threshold=threshold,
                      pair_id=pair.pair_id, tokenizer_hash=pair.tokenizer_hash)


def head_specs(pair) -> dict:
    d = int(pair.draft.config.hidden_size)
    text = pack_classes(token_classes(pair.tokenizer))
    return {"disco": ("disco", FeatureSpec("disco")),
            "disco_plus": ("disco_plus", FeatureSpec("disco_plus", groups=("verify", "copy", "token", "text"),
                                                     text_classes=text)),
            "disco_plus_hidden": ("disco_plus", FeatureSpec("disco_plus", d=d, groups=("verify", "hidden"))),
            "specdecpp": ("specdecpp", FeatureSpec("hidden", d=d))}


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory):
    """A disco_plus head (verify, copy, token groups) from `python -m train`'s job on the smoke experiment: tiny-pair
    MBPP traces made by data_gen, Lightning training, calibration and the stored speed rule."""
    from train.job import run

    root = tmp_path_factory.mktemp("hf_generate_head")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["+experiment=smoke", "model=disco_plus", "logger=none",
                                          f"trace_root={root / 'traces'}", "trainer.max_epochs=2"])
    with open_dict(cfg):
        cfg.trainer.enable_progress_bar = False
        cfg.progress = False
    return run(cfg, root / "run")["ckpt_path"]


def rounds_of_decode(pair, ids, policy, max_new=MAX_NEW):
    return speculative(pair, ids, policy, max_new, eos={pair.tokenizer.eos_token_id}).rounds


def varied_threshold(pair, bundle, ids) -> float:
    """A threshold among the head's own scores on this prompt under which decode's rounds differ in length."""
    probe = Learned(bundle, threshold=0.5, max_len=6)
    scores, score = [], probe.score
    probe.score = lambda x: scores.append(score(x)) or scores[-1]
    rounds_of_decode(pair, ids, probe)
    for q in (0.5, 0.3, 0.7, 0.1, 0.9):
        threshold = float(torch.tensor(scores).quantile(q))
        ks = [k for k, _ in rounds_of_decode(pair, ids, Learned(bundle, threshold=threshold, max_len=6))]
        if len(set(ks[:-1])) > 1:
            return threshold
    return 0.5


# ------------------------------------------------------------------------------------------- lossless, same rounds


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["auto", "threshold"])
def test_trained_head_greedy_identical_to_plain_generate(tiny_pair, trained_head, rule):
    """auto: the checkpoint's stored rule (expected value under the pair's cost profile); threshold: its F1 one."""
    hook = stop_policy_generator(trained_head, tiny_pair.draft, pair=tiny_pair, tokenizer=tiny_pair.tokenizer,
                                 rule=rule)
    assert isinstance(hook.policy, Learned) and hook.policy.needs_context and hook.policy.needs_verify_stats
    for text in PROMPTS:
        ids = ids_of(tiny_pair, text)
        assert hooked(tiny_pair, hook, ids) == plain(tiny_pair, ids), text
        twin = build_policy(f"learned:{trained_head}", {"rule": rule}, pair=tiny_pair)
        assert hook.rounds == rounds_of_decode(tiny_pair, ids, twin), text


@pytest.mark.parametrize("spec", ["constant", "svip", Constant(k=3), "heuristic", "adaedl"], ids=str)
def test_training_free_policy_greedy_identical_with_decodes_rounds(tiny_pair, spec):
    hook = stop_policy_generator(spec, tiny_pair.draft)
    for text in PROMPTS:
        ids = ids_of(tiny_pair, text)
        assert hooked(tiny_pair, hook, ids) == plain(tiny_pair, ids), text
        twin = build_policy(spec, {}) if isinstance(spec, str) else Constant(k=3)
        assert hook.rounds == rounds_of_decode(tiny_pair, ids, twin), text
    assert "_get_candidate_generator" not in vars(tiny_pair.target)  # the override lived for the call only


@pytest.mark.parametrize("name", ["disco", "disco_plus", "disco_plus_hidden", "specdecpp"])
def test_head_sees_decodes_feature_rows(tiny_pair, name):
    """Per drafted token the head scores the same row as in decode/loop.py (context, verification statistics, token
    classes, hidden state included), so the rounds match and the output is plain greedy generate()'s."""
    kind, spec = head_specs(tiny_pair)[name]
    bundle = random_head(tiny_pair, kind, spec)
    varied = False
    for text in PROMPTS:
        ids = ids_of(tiny_pair, text)
        threshold = varied_threshold(tiny_pair, bundle, ids)
        rows, rounds = {}, {}
        for how in ("decode", "hf_generate"):
            pol = Learned(bundle, threshold=threshold, max_len=6)
            seen, score = [], pol.score
            pol.score = lambda x, seen=seen, score=score: (seen.append(x.clone()), score(x))[1]
            if how == "decode":
                rounds[how] = rounds_of_decode(tiny_pair, ids, pol)
            else:
                hook = stop_policy_generator(pol, tiny_pair.draft)
                assert hooked(tiny_pair, hook, ids) == plain(tiny_pair, ids), text
                rounds[how] = hook.rounds
            rows[how] = torch.stack(seen)
        assert rounds["hf_generate"] == rounds["decode"], text
        torch.testing.assert_close(rows["hf_generate"], rows["decode"], rtol=0, atol=1e-4)
        varied |= len({k for k, _ in rounds["decode"][:-1]}) > 1
    assert varied  # the head's decisions, not a cap, set the lengths


# ------------------------------------------------------------------------------------- decisions set the lengths


class Cycle(StopPolicy):
    """Drafts 1, 3, 2, 4, 1, 3, ... tokens in successive rounds (a decision per token, the round count via observe)."""

    name = "cycle"
    needs_probs = False

    def __init__(self):
        super().__init__(max_len=10)
        self.lengths, self.round = [1, 3, 2, 4], 0

    def reset(self, **ctx):
        self.round = 0

    def should_stop(self, step):
        return step.position_in_round + 1 >= self.lengths[self.round % 4]

    def observe(self, drafted, accepted):
        self.round += 1


def test_policy_decisions_set_every_draft_length(tiny_pair):
    """The draft really stops where the policy says: per-round lengths follow the policy and the draft model runs
    exactly Σ drafted forwards (transformers' own setting would draft 20 per round)."""
    calls = []
    handle = tiny_pair.draft.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for policy, want in ((Constant(k=1), lambda i: 1), (Cycle(), lambda i: [1, 3, 2, 4][i % 4])):
            hook = stop_policy_generator(policy, tiny_pair.draft)
            calls.clear()
            ids = ids_of(tiny_pair, PROMPTS[0])
            out = hooked(tiny_pair, hook, ids, max_new=40)
            ks, done, capped = [k for k, _ in hook.rounds], 0, []
            for i, (k, n) in enumerate(hook.rounds):  # the token budget caps a round near the end: 40 − done − 1
                capped.append(min(want(i), 40 - done - 1))
                done += n + 1
            assert ks == capped and len(ks) >= 8
            assert len(calls) == sum(ks)
            assert len(out) == sum(n + 1 for _, n in hook.rounds) == 40
    finally:
        handle.remove()


def test_sampling_runs_under_the_policy(tiny_pair):
    """do_sample=True: transformers' speculative sampling with the policy's lengths (exact in law; not token-checked)."""
    hook = stop_policy_generator("constant", tiny_pair.draft, k=2)
    torch.manual_seed(0)
    out = hooked(tiny_pair, hook, ids_of(tiny_pair, PROMPTS[1]), max_new=24, do_sample=True, temperature=1.0, top_k=0)
    assert 0 < len(out) <= 24 and all(k <= 2 for k, _ in hook.rounds) and hook.rounds[0][0] == 2


def test_generate_helper_and_models_left_as_they_were(tiny_pair):
    draft = copy.deepcopy(tiny_pair.draft)
    gc = draft.generation_config
    gc.num_assistant_tokens_schedule, gc.num_assistant_tokens = "heuristic", 7  # transformers writes its K back here
    before = gc.to_dict()
    ids = ids_of(tiny_pair, PROMPTS[2])
    x = torch.tensor([ids])
    out = generate(tiny_pair.target, draft, x, "constant", params={"k": 2}, **gen_kwargs(tiny_pair, x))
    assert out[0, len(ids):].tolist() == plain(tiny_pair, ids)
    assert draft.generation_config.to_dict() == before
    hook = stop_policy_generator(Boom(), draft)
    with pytest.raises(RuntimeError, match="boom"):
        hooked(tiny_pair, hook, ids)
    assert "_get_candidate_generator" not in vars(tiny_pair.target)


class Boom(Constant):
    def should_stop(self, step):
        raise RuntimeError("boom")


# ------------------------------------------------------------------------------------------------------ refusals


def _bundle(pair, **changes):
    kind, spec = head_specs(pair)["disco"]
    bundle = random_head(pair, kind, spec)
    for key, value in changes.items():
        setattr(bundle, key, value)
    return bundle


@pytest.mark.parametrize("make,message", [
    (lambda p: "sprinter", r"policy 'sprinter' cannot run inside transformers' generate\(\): it needs approximate"),
    (lambda p: Sprinter(_bundle(p, kind="sprinter")), "policy 'sprinter' cannot run inside"),
    (lambda p: "oracle", "policy 'oracle' cannot run inside .* needs the target-only output"),
    (lambda p: "hf_assisted", "policy 'hf_assisted' cannot run inside"),
    (lambda p: "no_such_policy", "unknown policy 'no_such_policy'"),
    (lambda p: "no/such/head.ckpt", "head checkpoint no/such/head.ckpt not found"),
    (lambda p: object(), "policy must be a stop policy .* got object"),
    (lambda p: "expected_value", "policy expected_value reads the measured cost profile"),
    (lambda p: _bundle(p, calibration={"temperature": 1.0, "bias": 0.0, "mode": "platt"}),
     r"stop rule expected_value\) reads the measured cost profile.*rule='threshold'"),
    (lambda p: _bundle(p, tokenizer_hash="0123"), "trained on pair tiny_random \\(tokenizer 0123\\) but this tokenizer"),
    (lambda p: random_head(p, "specdecpp", FeatureSpec("hidden", d=7)), "hidden states of size 7 but this draft's"),
], ids=["sprinter", "sprinter_obj", "oracle", "hf_assisted", "unknown", "missing_ckpt", "not_a_policy",
        "ev_no_profile", "head_ev_no_profile", "tokenizer", "hidden_size"])
def test_what_the_hook_cannot_run_is_one_user_error(tiny_pair, make, message):
    with pytest.raises(UserError, match=message) as err:
        stop_policy_generator(make(tiny_pair), tiny_pair.draft, tokenizer=tiny_pair.tokenizer)
    assert "\n" not in str(err.value)


def test_bad_parameters_and_beams_are_user_errors(tiny_pair):
    with pytest.raises(UserError, match="go to a policy built here"):
        resolve_policy(Constant(k=2), tiny_pair.draft, k=3)
    with pytest.raises(UserError, match="bad parameter for policy svip"):
        stop_policy_generator("svip", tiny_pair.draft, nonsense=1)
    with pytest.raises(UserError, match="pair smollm2_135m"):
        stop_policy_generator(_bundle(tiny_pair, pair_id="smollm2_135m"), tiny_pair.draft, pair=tiny_pair)
    hook = stop_policy_generator("constant", tiny_pair.draft)
    with pytest.raises(UserError, match="num_beams=1"):
        hooked(tiny_pair, hook, ids_of(tiny_pair, PROMPTS[0]), num_beams=2)


# --------------------------------------------------------------------------------------------------------- bench


@pytest.mark.slow
def test_bench_writes_the_table_and_the_bar(tmp_path, trained_head):
    from bench.hf_generate import run

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench/hf_generate", overrides=["pair=tiny_random", f"ckpt={trained_head}", "limit=2",
                                                      "max_new_tokens=12", f"out_dir={tmp_path}"])
    run(cfg)
    bar = json.loads((tmp_path / "bar.json").read_text())
    assert {"prompts", "identical", "ours_s", "transformers_dynamic_s", "target_only_s"} <= set(bar)
    assert bar["prompts"] == 2 and bar["identical"] is True and bar["ours_s"] > 0
    assert bar["methods"]["transformers_dynamic"]["identical_prompts"] == 2
    md = (tmp_path / "summary.md").read_text()
    assert "| ours: stop head in generate() |" in md and "dtype float32" in md and "Machine:" in md
