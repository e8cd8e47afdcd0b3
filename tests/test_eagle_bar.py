"""eval.eagle_bar gathers issue 53's numbers from decode folders: the best method per drafter, EAGLE-3's best tree
apart from its chains, and the run with the kernels capped at AVX2 (its ratio is the AVX2-only bar)."""

import json

import pytest

from eval.eagle_bar import avx2_part, gather, markdown
from utils.cli import UserError


def _run(folder, rows, machine="AMD EPYC, 2 cores"):
    folder.mkdir(parents=True)
    summary = {"target": {"speedup": 1.0}}
    for key, (speed, c, tau) in rows.items():
        summary[key] = {"drafter": key.split("/")[0], "speedup": speed, "measured_c": c, "mean_accepted_length": tau,
                        "n_prompts": 20}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "run.json").write_text(json.dumps({"machine": machine, "dtype": "torch.float32", "date": "d"}))
    return folder


def test_gather_picks_best_chain_tree_and_the_avx2_ratio(tmp_path):
    mbpp = _run(tmp_path / "mbpp", {"student/expected_value": (2.0, 0.1, 2.9), "student/eagle2": (2.1, 0.1, 3.0),
                                    "eagle3/constant": (1.8, 0.05, 2.3), "eagle3/eagle2": (1.9, 0.05, 2.4),
                                    "eagle3/eagle2_svip": (1.85, 0.05, 2.3)})
    capped = "AMD EPYC, 2 cores, kernels capped by ONEDNN_MAX_CPU_ISA=AVX2"
    avx2 = _run(tmp_path / "avx2", {"student/constant": (1.5, 0.16, 2.9), "eagle3/eagle2": (1.65, 0.07, 2.4)}, capped)
    res = gather(mbpp, None, None, avx2)
    assert res["mbpp"]["student_best"] == 2.1 and res["mbpp"]["methods"]["student"] == "student/eagle2"
    assert res["mbpp"]["eagle_best"] == 1.8 and res["mbpp"]["eagle_tree_best"] == 1.9  # chains and trees apart
    assert res["svip_eagle2"] == {"eagle2": 1.9, "svip_eagle2": 1.85}
    assert res["avx2"]["ratio"] == pytest.approx(1.1) and res["avx2"]["machine"] == capped
    assert any(m.startswith("specbench") for m in res["missing"]) and any(m.startswith("heads") for m in res["missing"])
    assert "ratio 1.100" in markdown(res)
    assert gather(mbpp, None, None, tmp_path / "absent")["avx2"] is None


def test_avx2_run_without_eagle3_rows_is_refused(tmp_path):
    only_student = _run(tmp_path / "avx2", {"student/constant": (1.5, 0.16, 2.9)})
    with pytest.raises(UserError, match="drafters=\\[student,eagle3\\]"):
        avx2_part(only_student)
