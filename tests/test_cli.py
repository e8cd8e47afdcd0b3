"""utils.cli: a mistyped `group=name` is one error line before Hydra starts, and a name a user's own conf dir adds
(`hydra.searchpath=[file:///DIR]`) is known — so a label scheme, trace kind or pair source defined outside conf/ is
usable from the command line."""

from __future__ import annotations

import pytest

from utils.cli import UserError, _check_argv_groups, argv_search_path


def test_a_mistyped_group_name_is_one_line_listing_the_known_names():
    with pytest.raises(UserError, match=r"unknown labels 'ratioo'; known: .*ratio"):
        _check_argv_groups(["labels=ratioo"], "train")


def test_a_name_in_a_user_conf_dir_is_known(tmp_path):
    (tmp_path / "labels").mkdir()
    (tmp_path / "labels" / "mine.yaml").write_text("_target_: x.Y\n")
    with pytest.raises(UserError, match="unknown labels 'mine'"):
        _check_argv_groups(["labels=mine"], "train")
    for searchpath in (f"hydra.searchpath=[file://{tmp_path}]", f"hydra.searchpath=['file://{tmp_path}',pkg://x]"):
        assert argv_search_path([searchpath]) == (tmp_path,)
        _check_argv_groups(["labels=mine", searchpath], "train")
    with pytest.raises(UserError, match=r"unknown labels 'other'; known: .*mine"):
        _check_argv_groups(["labels=other", f"hydra.searchpath=[file://{tmp_path}]"], "train")
