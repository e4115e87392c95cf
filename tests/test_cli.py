"""`rlx validate`: exit status and where the message goes, as users' scripts see them."""
import os
import subprocess
import sys

import pytest

from launch.assets import make_addition_data, make_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_tiny_model(str(root / "model")), make_addition_data(str(root / "data"))


def rlx(*args):
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_validate_accepts_the_quickstart_and_prints_the_layout(assets):
    model, data = assets
    proc = rlx("validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
               f"data.train_files=[{data}]", f"data.val_files=[{data}]")
    assert proc.returncode == 0, proc.stderr
    assert "valid (cpu profile, 3 GPUs)" in proc.stdout
    assert "actor      actor    2     2   1   1" in proc.stdout


@pytest.mark.parametrize("override,message", [
    ("actor.tpp=2", "unknown key actor.tpp"),
    ("actor.tp=two", "actor.tp='two' has the wrong type, expected an integer"),
    ("resources.pools.actor=3 actor.tp=1 actor.pp=3", "actor.pp=3 does not divide the model's 4 layers"),
    ("rollout.engines=2", "rollout.engines*rollout.tp=2*1=2 does not equal the 1 GPUs of pool 'rollout'"),
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator='ppo' is not one of: gae, grpo, drgrpo, rloo, "
     "reinforce_plus_plus, reinforce_plus_plus_baseline, remax"),
    ("data.train_files=[missing.parquet]", "data.train_files[0]=missing.parquet not found"),
])
def test_validate_rejects_with_one_sentence_on_stderr(assets, override, message):
    model, data = assets
    proc = rlx("validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
               f"data.train_files=[{data}]", f"data.val_files=[{data}]", *override.split())
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_train_rejects_before_starting_anything(assets, tmp_path):
    model, data = assets
    proc = rlx("train", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}", f"data.train_files=[{data}]",
               f"data.val_files=[{data}]", f"trainer.run_dir={tmp_path / 'run'}", "actor.tp=3")
    assert proc.returncode == 2 and "actor.tp*actor.pp=3*1=3 does not divide" in proc.stderr
    assert not (tmp_path / "run").exists(), "a rejected spec must not create the run folder"


def test_validate_names_a_malformed_data_row(assets, tmp_path):
    model, _ = assets
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}, '
                   '"data_source": "x"}\n'
                   '{"prompt": "1+2=", "reward_model": {"ground_truth": "3"}, "data_source": "x"}\n')
    proc = rlx("validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
               f"data.train_files=[{bad}]", "data.val_files=[]")
    assert proc.returncode == 2
    assert f"{bad} row 1 (line 2): 'prompt' must be a non-empty list" in proc.stderr, proc.stderr


def test_show_prints_every_key_with_defaults_and_overrides():
    import yaml

    proc = rlx("show", "yaml_configs/quickstart_cpu.yaml", "rollout.top_p=0.9")
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load(proc.stdout)
    assert spec["actor"]["tp"] == 2  # from the file
    assert spec["rollout"]["top_p"] == 0.9  # from the override
    assert spec["actor"]["optim"]["adam_beta2"] == 0.999  # a default from rlcore/config.py
    assert set(spec) == {"model", "resources", "actor", "reference", "critic", "rollout", "data", "reward",
                         "algorithm", "trainer"}
