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
