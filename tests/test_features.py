"""models.features: the disco_plus rows decode builds from the loop's state are the rows trace loading builds from the
stored columns (greedy target_ar, every position up to each round's first rejection), and the copy features mean
what their docstring says."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import REPO
from utils.files import read_jsonl

N_PROMPTS, NEW = 3, 24


@pytest.fixture(scope="module")
def plus_traces(tmp_path_factory, tiny_pair):
    from data_gen.run import generate

    root = tmp_path_factory.mktemp("plus_traces")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("data_gen", ["pair=tiny_random", "dataset=mbpp", f"trace_root={root}", "progress=false",
                                   f"trace.max_new_tokens={NEW}", "trace.store_hidden=true", "split=test",
                                   f"limit={N_PROMPTS}"])
    return generate(cfg, "test", tiny_pair)


class Recorder:
    """A never-stopping policy that records the disco_plus row of every drafted token, kept up to the round's first
    rejection (the positions where the decoder's context is the target's)."""

    name = "recorder"
    needs_probs = needs_hidden = needs_context = needs_verify_stats = True
    approximate = False
    max_len = 10 * NEW

    def __init__(self, spec):
        from models.features.chain import PlusFeatures

        self.plus = PlusFeatures(spec)
        self.rows: dict[int, torch.Tensor] = {}
        self._round: list[tuple[int, torch.Tensor]] = []
        self.rounds: list[tuple[int, int]] = []

    def reset(self, **ctx):
        self.plus.reset()

    def should_stop(self, step):
        self._round.append((step.position, self.plus.row(step).clone()))
        return False

    def observe(self, drafted, accepted):
        self.rounds.append((drafted, accepted))
        for pos, row in self._round[: accepted + 1]:
            self.rows[pos] = row
        self._round = []


def test_decode_rows_equal_trace_rows(plus_traces, tiny_pair):
    from data_gen.store import load_traces
    from decode.loop import autoregressive, speculative
    from models.features.layout import GROUPS, TEXT
    from models.features.spec import FeatureSpec, features_from_columns, needed_columns
    from models.features.text import pack_classes, token_classes
    from models.features.trace import continuation_starts
    from data_gen.contract import trace_columns

    ds, manifest = load_traces(plus_traces)
    spec = FeatureSpec("disco_plus", k=10, d=int(manifest["hidden_size"]), groups=GROUPS,
                       text_classes=pack_classes(token_classes(tiny_pair.tokenizer)))
    cols = trace_columns(ds, list(needed_columns(spec)))
    x = features_from_columns(cols, spec)
    assert x.shape == (len(ds), spec.dim)
    starts = np.flatnonzero(continuation_starts(cols))
    ends = np.append(starts[1:], len(ds))
    names = spec.names
    exact = [names.index(n) for n in ("position_in_round", "last_accepted", "last_all_accepted", "copy_len",
                                      "lookup_hit", "lookup_len", "draft_token_id", "prev_token_id", *TEXT)]
    hidden = list(range(spec.dim - spec.d, spec.dim))  # stored as fp16 in the traces
    approx = [i for i in range(spec.dim) if i not in exact and i not in hidden]
    compared = rejected_rounds = 0
    for a, b in zip(starts, ends):
        prompt = [int(t) for t in cols["prompt_tokens"][a]]
        rec = Recorder(spec)
        res = speculative(tiny_pair, prompt, rec, max_new_tokens=NEW, eos=tiny_pair.eos_ids)
        target = autoregressive(tiny_pair, prompt, NEW, eos=tiny_pair.eos_ids).tokens
        assert res.tokens == target == cols["context_token"][a:b].tolist()  # lossless, and the trace's path
        rejected_rounds += sum(n < k for k, n in rec.rounds)
        for pos, row in rec.rows.items():
            want = x[a + pos]
            assert torch.equal(row[exact], want[exact]), (pos, row[exact], want[exact])
            # float features: the same definitions, two fp32 passes (batched teacher-forced vs incremental): ~5e-6 apart
            torch.testing.assert_close(row[approx], want[approx], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(row[hidden], want[hidden], atol=1e-3, rtol=1e-3)
            compared += 1
    assert compared > 2 * N_PROMPTS and rejected_rounds > 0
    # the groups carried something on these rows: verification after a first round, copies of the context
    col = {n: x[:, names.index(n)] for n in names}
    assert (col["target_entropy"] > 0).any() and (col["last_accepted"] > 0).any()
    assert (col["copy_len"] > 0).any() and (col["lookup_len"] > 0).any()
    assert (col["line_position"] > 0).any() and (col["draft_chars"] > 0).any()


def test_text_classes_by_hand():
    """token_classes reads byte-level BPE marks; pack/unpack keeps the table; the line position counts the tokens
    after the last newline, and the trace columns continue it across the context."""
    import numpy as np

    from models.features.layout import CLASSES
    from models.features.text import advance_line, pack_classes, token_classes, unpack_classes
    from models.features.trace import text_columns

    class Tok:
        pieces = ["def", "Ġfoo", "(", "):", "Ċ", "ĠĠĠ", "Ġreturn", "Ġ42", "ĊĊ"]

        def __len__(self):
            return len(self.pieces)

        def convert_ids_to_tokens(self, ids):
            return [self.pieces[i] for i in ids]

    table = token_classes(Tok())
    c = {name: i for i, name in enumerate(CLASSES)}
    assert table[1, c["space"]] == 1 and table[1, c["alpha"]] == 1 and table[1, c["chars"]] == 3
    assert table[3, c["punct"]] == 1 and table[7, c["digit"]] == 1
    assert table[4, c["newline"]] == table[8, c["newline"]] == 1 and table[0, c["newline"]] == 0
    assert np.array_equal(unpack_classes(pack_classes(table)), table)
    assert advance_line(0, [0, 1, 2, 3, 4, 5, 6], table) == 2
    assert advance_line(0, [0, 1, 2], table) == 3 and advance_line(0, [0, 4], table) == 0
    cols = {"position": np.arange(4), "prompt_id": np.array(["p"] * 4), "prompt_tokens": [[0, 1, 2, 3]] * 4,
            "context_token": np.array([4, 5, 6, 7]), "draft_token": np.array([4, 6, 6, 99])}
    out = text_columns(cols, table)
    assert out[:, -1].tolist() == [4, 0, 1, 2]  # after "def foo():" 4 tokens; then newline resets the count
    assert out[0, : len(CLASSES)].tolist() == table[4].tolist()  # the drafted token's classes
    assert out[1, len(CLASSES) : 2 * len(CLASSES)].tolist() == table[4].tolist()  # the previous (context) token's
    assert not out[3, : len(CLASSES)].any()  # an id past the tokenizer has no classes


def test_copy_features_by_hand():
    from models.features.context import ContextIndex

    idx = ContextIndex([5, 6, 7, 8, 5, 6])
    # 7 continues "5 6" (which is followed by 7 at the start): a 3-gram "5 6 7"; prompt lookup on "5 6" proposes 7
    assert idx.copy_features(7) == [3.0, 1.0, 2.0]
    assert idx.copy_features(9) == [0.0, 0.0, 2.0]  # never seen; the lookup proposal (7) is not 9
    assert idx.copy_features(8) == [1.0, 0.0, 2.0]  # seen, but not after 6
    mark = idx.mark()
    idx.push(7)
    assert idx.copy_features(8) == [4.0, 1.0, 3.0]  # "5 6 7 8" recurs; lookup on "5 6 7" proposes 8
    idx.rollback(mark)
    assert idx.toks == [5, 6, 7, 8, 5, 6] and idx.copy_features(7) == [3.0, 1.0, 2.0]


def test_old_traces_refused_in_one_line(plus_traces):
    """Traces without the new columns (made before disco_plus) are refused, naming the fix, not misread."""
    from omegaconf import OmegaConf

    from data_gen.store import load_traces
    from models.features.spec import FeatureSpec
    from train.datamodule import TraceDataModule
    from utils.cli import UserError

    ds, _ = load_traces(plus_traces)
    old = ds.remove_columns(["context_token", "prompt_tokens", "target_margin"])
    dm = TraceDataModule({s: old for s in ("train", "validation", "test")}, OmegaConf.create({"name": "greedy_match"}),
                         FeatureSpec("disco_plus", groups=["verify", "copy"]))
    with pytest.raises(UserError, match="overwrite=true") as err:
        dm.setup()
    assert "\n" not in str(err.value)


def test_disco_plus_trains_calibrates_and_decodes_losslessly(tmp_path, tiny_pair):
    """model=disco_plus end to end on the tiny pair: traces → head (calibrated on validation) → learned:CKPT in the
    decoder, which feeds it context and verification statistics and stays token-identical to target-only decoding."""
    import json

    from omegaconf import open_dict

    from decode.runner import main as decode
    from models.heads import load_head
    from train.job import run

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", ["pair=tiny_random", "logger=none", "dataset=mbpp", "model=disco_plus",
                                f"trace_root={tmp_path / 'traces'}", "split_limits.train=3", "split_limits.validation=3",
                                "split_limits.test=3", f"trace.max_new_tokens={NEW}", "trainer.max_epochs=3",
                                "data.batch_size=16", "labels.reach_weight=0.5", "model.groups=[verify,copy,token,text]"])
        with open_dict(cfg):
            cfg.trainer.enable_progress_bar = False
        res = run(cfg, tmp_path / "run")
        bundle = load_head(res["ckpt_path"])
        assert bundle.spec.kind == "disco_plus" and bundle.spec.groups == ("verify", "copy", "token", "text")
        assert len(bundle.spec.classes) == len(tiny_pair.tokenizer)  # the text group's table travels in the ckpt
        assert bundle.calibration["mode"] == "platt" and 0 <= res["test/ece"] <= 1
        # item 5: train chose the stop rule for speed on validation (the best of the replayed candidates) and stored
        # it; learned:<ckpt> with no threshold decodes with it
        sr = res["speed_rule"]
        assert sr["cost_model_speedup"] == max(sr["candidates"].values()) and len(sr["candidates"]) == 8
        assert bundle.decode_rule == {k: sr[k] for k in ("rule", "threshold") if k in sr}
        out = tmp_path / "decode"
        dcfg = compose("decode", ["pair=tiny_random", "dataset=mbpp", "split=test", "limit=3",
                                  f"max_new_tokens={NEW}", "plots=false", "warmup=false",
                                  f"policies=[learned:{res['ckpt_path']}]", f"out_dir={out}"])
    decode(dcfg)
    summary = json.loads((out / "summary.json").read_text())
    row = next(v for k, v in summary.items() if k.startswith("learned"))
    assert row["lossless"] is True and row["acceptance_rate"] >= 0

    # the replay feeds the head the context and verification statistics as the loop does: on the same prompts its
    # accepted counts are the decoder's in every round, and so is its draft length where it stopped by then
    from decode.policies import build_policy
    from eval.continuations import load_continuations
    from eval.replay import replay_one
    from models.cost import CostProfile

    profile = CostProfile.from_dict(json.loads((out / "run.json").read_text())["cost_profile"])
    pol = build_policy(f"learned:{res['ckpt_path']}", {}, profile=profile)
    assert pol.needs_context and pol.needs_verify_stats
    assert (pol.rule is not None) == (sr["rule"] == "expected_value")
    assert sr["rule"] == "expected_value" or pol.threshold == pytest.approx(sr["threshold"])
    conts, _, _ = load_continuations(next((tmp_path / "traces").glob("*--test*")))
    rows = read_jsonl(out / "prompts.jsonl")
    decoded = [[tuple(r) for r in row["rounds"]] for row in rows if row["method"].startswith("learned")]
    assert len(decoded) == len(conts) == 3
    exact = 0
    for dec, cont in zip(decoded, conts):
        rep = replay_one(pol, cont)
        assert [n for _, n in rep] == [n for _, n in dec]
        for (kd, n), (kr, _) in zip(dec, rep):
            assert (kd <= n + 1) == (kr <= n + 1) and (kd == kr or kd > n + 1)
            exact += kd <= n + 1
    assert exact > 0


def test_greedy_ids_is_argmax_with_ties():
    from models.distributions import greedy_ids

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        z = (torch.randn(5, 4000, generator=g) * 2).round().to(dtype)  # integer logits: many tied maxima
        z[1, :100] = float("-inf")
        z[2, 7] = z[2, 3000] = float("inf")
        assert torch.equal(greedy_ids(z), z.argmax(-1))
        assert int(greedy_ids(z[0])) == int(z[0].argmax())


@pytest.mark.parametrize("subset", [True, False])
def test_logit_stats_match_the_definitions(subset):
    """What the loop reads from greedy verification logits equals entropy, top2_margin and tvd of p = softmax(z) with
    q given on its support (a reduced-vocabulary draft is 0 elsewhere) — the trace columns' definitions."""
    from models.distributions import entropy, logit_stats, top2_margin, tvd

    g = torch.Generator().manual_seed(1)
    vocab, rows = 3000, 4
    z = (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    support = torch.randperm(vocab, generator=g)[:500].sort().values if subset else None
    q = torch.zeros(rows - 1, vocab)
    cols = support if subset else torch.arange(vocab)
    q[:, cols] = torch.softmax(torch.randn(rows - 1, len(cols), generator=g) * 3, -1)
    ent, margin, tv = logit_stats(z, support, q[:, cols])
    p = torch.softmax(z.float(), -1)
    assert float(ent) == pytest.approx(float(entropy(p[-1])), rel=1e-4, abs=1e-5)
    assert float(margin) == pytest.approx(float(top2_margin(p[-1])), abs=1e-6)
    assert torch.allclose(tv, tvd(p[: rows - 1], q), atol=1e-5)
    ent0, margin0, tv0 = logit_stats(z[:1], support, None)  # a round that kept nothing drafted: no TVD rows
    assert tv0.numel() == 0 and float(margin0) == pytest.approx(float(top2_margin(p[0])), abs=1e-6)
