"""The recipes users copy (docs/recipes/*.yaml, docs/policies.md's "RL on a public LIBERO checkpoint")
compose and pass every check a run makes before its workers start. A 7B checkpoint is not here: a tiny one of
the same family (assets/reference/, the same files and fields) stands in for it."""

from pathlib import Path

import pytest

from embodied.checks import check_run_config
from embodied.config import compose
from embodied.config_files import file_overrides
from policies.registry import check_trainable
from tests.conftest import REPO

RECIPES = sorted((REPO / "docs" / "recipes").glob("*.yaml"))
# per recipe: what stands in for its checkpoint (the tiny checkpoint stores two datasets' statistics)
STAND_INS = {
    "libero_grpo_simplevla": ["policy.vla.model_path=assets/reference/openvla_oft_token_tiny",
                              "policy.vla.unnorm_key=libero_spatial_no_noops"],
    "libero_ppo_rlinf": ["policy.vla.model_path=assets/reference/openvla_oft_token_tiny",
                         "policy.vla.unnorm_key=libero_spatial_no_noops"],
}


def test_every_recipe_is_covered():
    assert {p.stem for p in RECIPES} == {*STAND_INS, "two_nodes"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: Path(p).stem)
def test_a_recipe_runs_with_its_own_settings(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = compose([*file_overrides(recipe), *STAND_INS.get(recipe.stem, [])])
    check_run_config(cfg)
    check_trainable(cfg.policy)


def test_the_libero_recipes_train_what_their_authors_train():
    grpo = compose(file_overrides(REPO / "docs/recipes/libero_grpo_simplevla.yaml"))
    assert (grpo.env.task, grpo.algorithm.advantage, grpo.algorithm.group_size) == ("libero_10", "grpo", 8)
    ppo = compose(file_overrides(REPO / "docs/recipes/libero_ppo_rlinf.yaml"))
    assert (ppo.env.task, ppo.algorithm.advantage, ppo.policy.vla.stop_token) == ("libero_130", "gae", False)
    for cfg in (grpo, ppo):  # the checkpoints' authors' camera: 256 px, robosuite's default rendering
        assert (cfg.env.image_size, cfg.env.rendering) == (256, "reference")
