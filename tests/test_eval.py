"""python -m eval on tiny-pair traces: the report's numbers agree with an independent computation, the default traces
come from the checkpoint's training config, several checkpoints make one table, bad input gives one error line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from sklearn.metrics import roc_auc_score

from tests.conftest import REPO
from utils.cli import UserError

TRAIN_OVERRIDES = {
    "disco": ["+experiment=smoke", "trace.max_new_tokens=16"],
    "sprinter": ["+experiment=smoke", "trace=interleaved", "labels=ratio", "labels.tau=1.2", "model=sprinter",
                 "trace.max_new_tokens=16"],
}


def compose_cfg(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(name, overrides)


def fake_training_run(root, kind: str, pair, seed: int = 0, pair_id: str | None = None, d: int | None = None):
    """Traces for the test split + a head checkpoint in <run>/checkpoints/best.ckpt + <run>/.hydra/config.yaml, as
    `python -m train` leaves them (random head weights: eval only needs a head, not a good one)."""
    from data_gen.run import generate
    from data_gen.store import load_traces
    from models.features.spec import FeatureSpec
    from models.heads import CKPT_KEY, HeadBundle, build_head
    from data_gen.contract import split_cfg

    cfg = compose_cfg("train", [f"trace_root={root / 'traces'}", "batch_size=4", *TRAIN_OVERRIDES[kind]])
    _, manifest = load_traces(generate(split_cfg(cfg, "test"), "test", pair))
    spec = FeatureSpec("disco", k=10) if kind == "disco" else FeatureSpec("hidden", d=d or int(manifest["hidden_size"]))
    torch.manual_seed(seed)
    head = build_head(kind, spec)
    labels = OmegaConf.to_container(cfg.labels, resolve=True)
    bundle = HeadBundle(head, kind, spec, labels, 0.5, pair_id or manifest["pair_id"], manifest["tokenizer_hash"])
    run = root / f"run_{kind}_{seed}"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    ckpt = run / "checkpoints" / "best.ckpt"
    torch.save({"state_dict": {f"head.{k}": v for k, v in head.state_dict().items()}, CKPT_KEY: bundle.meta()}, ckpt)
    return ckpt


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_pair):
    root = tmp_path_factory.mktemp("evalruns")
    return {
        "root": root,
        "disco": fake_training_run(root, "disco", tiny_pair),
        "sprinter": fake_training_run(root, "sprinter", tiny_pair),
    }


def eval_cfg(*overrides):
    return compose_cfg("eval", list(overrides))


def independent_auroc(ckpt, root):
    """AUROC recomputed from the trace files with sklearn, without eval's code path."""
    from data_gen.labels import make_labels
    from data_gen.store import load_traces
    from models.features.spec import features_from_columns
    from models.heads import load_head
    from data_gen.contract import trace_columns

    bundle = load_head(ckpt)
    folder = next((root / "traces").glob("*target_ar*--test*"))
    ds, _ = load_traces(folder)
    cols = trace_columns(ds, ds.column_names)
    y = make_labels(cols, OmegaConf.create(bundle.labels))
    s = bundle.prob(features_from_columns(cols, bundle.spec)).numpy()
    return roc_auc_score(y >= 0.5, s), len(y), roc_auc_score(y >= 0.5, -np.asarray(cols["draft_entropy"]))


def test_disco_report_numbers_and_plots(runs, tmp_path):
    from eval.classifier import run

    out = tmp_path / "out"
    report = run(eval_cfg(f"ckpt={runs['disco']}", f"out_dir={out}"))
    saved = json.loads((out / "report.json").read_text())
    for key in ("auroc", "ap", "f1", "threshold", "ece", "per_position_auroc", "f1_static_best", "precision", "recall",
                "confusion", "best_f1_threshold", "best_f1"):
        assert key in saved, key
    auroc, rows, entropy_auroc = independent_auroc(runs["disco"], runs["root"])
    assert saved["rows"] == rows
    assert saved["auroc"] == pytest.approx(auroc, abs=1e-9)
    # the training-free score the head must beat, on the same rows (SVIP/AdaEDL stop on entropy)
    assert saved["baseline_auroc"]["neg_entropy"] == pytest.approx(entropy_auroc, abs=1e-9)
    assert "−H_q" in (out / "report.md").read_text()
    c = saved["confusion"]
    assert c["tp"] + c["fp"] + c["tn"] + c["fn"] == rows
    assert saved["best_f1"] >= saved["f1"] - 1e-12  # the best-F1 threshold is at least as good on the same rows
    assert 0 <= saved["ece"] <= 1 and "0" in saved["per_position_auroc"]
    assert "target_ar" in saved["traces"]  # found through the run's .hydra/config.yaml
    for png in ("roc", "pr", "reliability", "per_position_auroc"):
        assert (out / f"{png}.png").stat().st_size > 1000
    assert "sprinter_theory" not in report


def test_threshold_override(runs, tmp_path):
    """threshold= replaces the checkpoint's threshold: everything-accepted at 0 (recall 1, no negatives predicted)."""
    from eval.classifier import run

    run(eval_cfg(f"ckpt={runs['disco']}", "threshold=0.0", f"out_dir={tmp_path / 'o'}"))
    saved = json.loads((tmp_path / "o" / "report.json").read_text())
    assert saved["threshold"] == 0.0 and saved["recall"] == 1.0
    assert saved["confusion"]["tn"] == 0 and saved["confusion"]["fn"] == 0


def test_sprinter_theory_and_comparison_via_cli(runs, tmp_path, cli):
    out = tmp_path / "cmp"
    proc = cli("eval", f"ckpt=[{runs['disco']},{runs['sprinter']}]", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert len(report["checkpoints"]) == 2 and len(report["comparison"]["auroc"]) == 2
    spr = report["checkpoints"][1]
    assert "interleaved" in spr["traces"] and spr["labels"]["tau"] == 1.2
    t = spr["sprinter_theory"]
    # Theorem 1 prediction is ε · mean TVD, and x ~ q on interleaved traces gives the exact per-step estimate too
    assert t["tvd_sprinter_pred"] == pytest.approx(t["fpr"] * t["tvd_pq_mean"])
    assert t["draft_tokens_sampled_from_q"] and 0 <= t["tvd_sprinter_from_samples"] <= t["tvd_pq_from_samples"] + 1e-9
    assert "SPRINTER theory" in proc.stdout and "| sprinter:" in proc.stdout and "| disco:" in proc.stdout
    assert (out / "roc.png").is_file()


def test_calibration_by_hand():
    from eval.classifier import calibration

    # every score 0.8, half the labels positive: one bin, |0.8 − 0.5| = 0.3
    cal = calibration(np.full(10, 0.8), np.r_[np.ones(5), np.zeros(5)])
    assert cal["ece"] == pytest.approx(0.3, abs=1e-6)
    assert cal["reliability"]["observed"] == [pytest.approx(0.5)]


def test_bad_inputs_are_one_line(runs, tmp_path, tiny_pair, cli):
    from eval.classifier import run

    not_ckpt = tmp_path / "notes.txt"
    not_ckpt.write_text("hello")
    proc = cli("eval", f"ckpt={not_ckpt}", f"out_dir={tmp_path / 'x'}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "checkpoint" in lines[0]
    assert not (tmp_path / "x").exists()
    cases = {
        "missing split": (eval_cfg(f"ckpt={runs['disco']}", "split=validation"), "validation"),
        "other pair": (eval_cfg(f"ckpt={fake_training_run(tmp_path, 'disco', tiny_pair, 1, pair_id='smollm2_135m')}"),
                       "pair"),
        "other spec": (eval_cfg(f"ckpt={fake_training_run(tmp_path, 'sprinter', tiny_pair, 2, d=32)}"), "hidden"),
        "disco on traces without hidden is fine, sprinter on target_ar is not": (
            eval_cfg(f"ckpt={runs['sprinter']}", f"traces={next((runs['root'] / 'traces').glob('*target_ar*--test*'))}"),
            "hidden"),
        "no ckpt": (eval_cfg(), "ckpt="),
    }
    for name, (cfg, needle) in cases.items():
        with pytest.raises(UserError, match=needle):
            run(OmegaConf.merge(cfg, {"out_dir": str(tmp_path / name.replace(" ", "_"))}))
        assert not (tmp_path / name.replace(" ", "_")).exists(), name


def test_study_report_and_stale_line(tmp_path):
    """eval.study writes a section per folder with its command; a section whose folder is missing says so, and a
    table made with other pair settings than today's defaults gets a stale line naming them (a setting the
    section's own command sets is not stale)."""
    from eval.staleness import stale_reasons
    from eval.study import Section, Study, build

    run = {"pair": "smollm2_135m", "device": "cpu", "dtype": "torch.float32", "machine": "m", "date": "d",
           "draft": {"vocab_subset": 8192, "quantize": "int8"}, "linear": "packed", "forward": {"draft": "lean"}}
    assert stale_reasons(run) == []
    old = {**run, "draft": {"vocab_subset": None}, "linear": None, "forward": None}
    reasons = stale_reasons(old)
    assert any(r.startswith("draft.vocab_subset=null") for r in reasons) and len(reasons) == 4
    assert len(stale_reasons(old, {"pair.draft.quantize", "pair.linear"})) == 2
    assert stale_reasons({**run, "pair": "gone"}) == ["pair gone, which conf/pair/ no longer defines"]
    # a record from before draft fingerprints names its FR-Spec list: another list means another draft (issue 29)
    first = {**run, "draft": {**run["draft"], "vocab_freq": "models/weights/smollm2_135m_vocab_freq.json"}}
    assert stale_reasons(first) == ["draft.vocab_freq=models/weights/smollm2_135m_vocab_freq.json "
                                    "(today models/weights/smollm2_135m_vocab_freq_responses.json)"]
    # a record of the draft's content: stale once another student ships at the same path (issue 29)
    from omegaconf import OmegaConf

    from models.pair import draft_files
    from utils.cli import CONF_DIR

    today = draft_files(OmegaConf.load(CONF_DIR / "pair" / "smollm2_135m.yaml"))
    assert today.get("weights") and stale_reasons({**run, "draft_files": today}) == []
    assert stale_reasons({**run, "draft_files": {**today, "weights": "0" * 16}}) == [
        f"draft weights {'0' * 16} (today {today['weights']})"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "run.json").write_text(json.dumps(old))
    (tmp_path / "a" / "summary.md").write_text("### table\n| x |\n")
    study = Study((Section("a", "A", ("python -m decode out_dir=results/a",), ("summary.md",)),
                   Section("b", "B", ("python -m decode out_dir=results/b",))))
    text = build(tmp_path, study)
    assert "python -m decode out_dir=results/a" in text and "#### table" in text and "Not run yet." in text
    assert "**Stale:** made with draft.vocab_subset=null (today 8192)" in text
    # --commands: the recipe of a folder (its sub-folders too, not a sibling sharing its prefix); --stale keeps
    # only the stale sections'
    from eval.study import commands
    from utils.cli import UserError

    study = Study((*study.sections, Section("a/x", "AX", ("python -m eval.bar out=results/a/x", "python -m decode "
                                                           "out_dir=results/a")), Section("ab", "AB", ("echo ab",))))
    assert commands(study, "a/") == ["python -m decode out_dir=results/a", "python -m eval.bar out=results/a/x"]
    # a is stale (its run.json); a/x has no files of its own but reads a's, so it is stale too; b was never run
    assert commands(study, "a", tmp_path) == commands(study, "a/")
    assert commands(study, "", tmp_path) == commands(study, "a/")
    assert len(commands(study)) == 4
    with pytest.raises(UserError, match="no section of the study lies under 'c'"):
        commands(study, "c")


def test_study_marks_files_committed_before_the_draft(tmp_path, monkeypatch):
    """eval.staleness: a result that records no draft fingerprint is stale when git last committed it before today's draft
    weights; one committed after them, one with uncommitted changes and one whose command picks another pair are
    not."""
    import subprocess
    import time

    import eval.staleness as study_mod
    from eval.study import Section

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    (tmp_path / "conf" / "pair").mkdir(parents=True)
    (tmp_path / "conf" / "decode.yaml").write_text("defaults:\n  - pair: p\n")
    (tmp_path / "conf" / "pair" / "p.yaml").write_text("name: p\ndraft:\n  weights: w.bin\n")
    for d in ("old", "new"):
        (tmp_path / "results" / d).mkdir(parents=True)
    (tmp_path / "results" / "old" / "r.json").write_text("{}")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "old result")
    (tmp_path / "w.bin").write_text("draft")
    git("add", "-A")
    time.sleep(1.1)  # commit times have 1 s resolution
    git("commit", "-q", "-m", "the draft")
    (tmp_path / "results" / "new" / "r.json").write_text("{}")
    time.sleep(1.1)
    git("add", "-A")
    git("commit", "-q", "-m", "new result")
    monkeypatch.setattr(study_mod, "REPO", tmp_path)
    monkeypatch.setattr(study_mod, "pair_defaults", lambda name: {"draft": {"weights": "w.bin"}} if name == "p" else None)
    results = tmp_path / "results"
    old, new = Section("old", "", ("python -m decode",)), Section("new", "", ("python -m decode",))
    assert "earlier draft" in study_mod.older_than_draft(results, old, [])
    assert study_mod.older_than_draft(results, new, []) == ""
    assert study_mod.older_than_draft(results, Section("old", "", ("python -m decode pair=q",)), []) == ""
    assert study_mod.older_than_draft(results, old, [{"pair": "p", "draft_files": {"weights": "x"}}]) == ""
    (results / "old" / "r.json").write_text('{"changed": 1}')
    assert study_mod.older_than_draft(results, old, []) == ""


def test_study_marks_sections_made_with_another_eagle3_draft(tmp_path, monkeypatch):
    """eval.staleness: a section drafting with its pair's EAGLE-3 draft is stale when its decode rows record other
    weights than today's (the file's fingerprint, or its committed .train.json's where the weights are not built),
    or, recording none, when git last committed its files before the draft shipped; a section built from a stale
    section's folder is stale too."""
    import subprocess
    import time

    import eval.staleness as study_mod
    from eval.study import Section

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "decode.yaml").write_text("defaults:\n  - pair: p\n")
    monkeypatch.setattr(study_mod, "REPO", tmp_path)
    monkeypatch.setattr(study_mod, "pair_defaults", lambda name: {"eagle3": {"weights": "e.safetensors"}})
    results = tmp_path / "results"
    for d in ("traced", "decoded"):
        (results / d).mkdir(parents=True)
    (results / "traced" / "replay.json").write_text("{}")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "a replay")
    (tmp_path / "e.train.json").write_text('{"fingerprint": "today"}')
    time.sleep(1.1)  # commit times have 1 s resolution
    git("add", "-A")
    git("commit", "-q", "-m", "the draft's record")
    traced = Section("traced", "", ("python -m data_gen trace=eagle_chain",))
    assert "an earlier EAGLE-3 draft" in study_mod.older_than_eagle3(results, traced, [])
    assert study_mod.older_than_eagle3(results, Section("traced", "", ("python -m decode",)), []) == ""
    mine = Section("traced", "", ("python -m decode drafters=[eagle3] drafter.eagle3.weights=x",))
    assert study_mod.older_than_eagle3(results, mine, []) == ""
    decoded = Section("decoded", "", ("python -m decode 'drafters=[eagle3]'",))
    rows = {"target": {}, "eagle3/svip": {"draft_weights": {"path": "e.safetensors", "fingerprint": "today"}}}
    (results / "decoded" / "summary.json").write_text(json.dumps(rows))
    assert study_mod.older_than_eagle3(results, decoded, []) == ""  # today's, by the .train.json's record
    (tmp_path / "e.safetensors").write_text("weights built here")  # now the file's own fingerprint counts
    assert "EAGLE-3 draft today (today " in study_mod.older_than_eagle3(results, decoded, [])
    bar = Section("bar", "", ("python -m eval.bar bar.replay=results/traced bar.out=results/bar/bar.json",))
    (results / "bar").mkdir()
    (results / "bar" / "bar.json").write_text("{}")
    assert study_mod.read_sections(bar, (traced, decoded, bar)) == [traced]
    assert "the stale files of traced" in study_mod.stale_line(results, bar, (traced, decoded, bar))
    assert study_mod.stale_line(results, bar) == ""


def test_study_owner_of_a_results_file():
    """Each file under results/ belongs to the deepest section folder above it; `only` sections claim their files."""
    from eval.study import Section, Study, owner

    s = Study((Section("x", "", ()), Section("x", "", (), only=("a.json",)), Section("x/y", "", ())))
    assert owner(s, "x/a.json") is s.sections[1] and owner(s, "x/b.json") is s.sections[0]
    assert owner(s, "x/y/z/c.png") is s.sections[2] and owner(s, "w/c.png") is None


def test_study_block_in_readme(tmp_path):
    """eval.study rewrites only the marked block of the top-level README; a README without it is a user error."""
    from eval.study import BEGIN, END, update_readme
    from utils.cli import UserError

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold\n{END}\noutro\n")
    update_readme(readme, "new table\n")
    assert readme.read_text() == f"intro\n{BEGIN}\nnew table\n{END}\noutro\n"
    readme.write_text("no block")
    with pytest.raises(UserError, match="block"):
        update_readme(readme, "x")


def test_study_manifest_names_existing_experiments():
    """conf/study.yaml is the list of result commands: every experiment it names is a file, a decoding study
    (conf/experiment/study/) for decode and eval.replay, a head's for train; the bar has issue 16's four thresholds."""
    import re

    from eval.study import load_study
    from utils.cli import CONF_DIR

    study = load_study()
    named = {(m, c.split()[2]) for s in study.sections for c in s.commands for m in re.findall(r"\+experiment=(\S+)", c)}
    assert named and all((CONF_DIR / "experiment" / f"{n}.yaml").is_file() for n, _ in named), named
    assert all(n.startswith("study/") == (stage in ("decode", "eval.replay")) for n, stage in named), named
    assert set(study.bar) == {"replay_ratio", "gap_closed", "wall_ratio", "auroc_gain"}


def test_headline_marks_a_bar_computed_from_an_earlier_replay(tmp_path):
    """The headline's cost column comes from bar.json; a rerun replay leaves it behind, which the block must say."""
    from eval.study import bar_behind

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "replay.json").write_text(json.dumps({"settings": {"date": "2026-11-26 19:08 UTC"}}))
    h = {"replay": "r", "bar": "bar.json"}
    assert bar_behind(tmp_path, h, {"replay_settings": {"date": "2026-11-26 19:08 UTC"}}) == []
    line = bar_behind(tmp_path, h, {"replay_settings": {"date": "2026-11-25 00:56 UTC"}})
    assert len(line) == 1 and "2026-11-25 00:56 UTC" in line[0] and "python -m eval.bar" in line[0]
