"""Shared fixtures: the tiny random pair (built once per session) and a subprocess runner for the CLIs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine run fastest single-threaded (modules opt in with pytestmark)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_cfg():
    return OmegaConf.load(REPO / "conf" / "pair" / "tiny_random.yaml")


@pytest.fixture(scope="session")
def tiny_pair(tiny_cfg):
    from models.pair import load_pair

    return load_pair(tiny_cfg)


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `python -m ...` like a user would; returns the completed process (text output). tests/ is on the
    child's PYTHONPATH so a class a test module defines (a policy, label scheme, trace kind, pair source, loss) is
    importable there under the name pytest gave it (`test_labels.DraftOverTarget`), as a user's own module would be."""
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def cli():
    return run_cli


def two_token_law(pair, ids: list[int], temperature: float = 1.0):
    """The target's joint law of the next two tokens after `ids`, p(t1)·p(t2 | t1), as a (V, V) float64 tensor:
    what exact speculative sampling must reproduce (the χ² tests)."""
    import torch

    from models.distributions import draft_probs

    with torch.no_grad():
        base = torch.tensor([ids])
        p1 = draft_probs(pair.target(base).logits[0, -1, : pair.vocab_size], temperature)
        v = p1.shape[0]
        batch = torch.cat([base.repeat(v, 1), torch.arange(v).view(v, 1)], 1)
        p2 = draft_probs(pair.target(batch).logits[:, -1, : pair.vocab_size], temperature)
    return (p1.view(v, 1) * p2).double()


def law_chisquare(counts, joint, n: int) -> tuple[int, float]:
    """(bins, p-value) of observed (t1, t2) counts against `joint`: bins with expected count ≥ 15, plus one 'rest'."""
    import numpy as np
    from scipy.stats import chisquare

    expected = joint * n
    big = expected >= 15
    obs = np.append(counts[big].numpy(), counts[~big].sum().item())
    exp = np.append(expected[big].numpy(), expected[~big].sum().item())
    return int(big.sum()), float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
