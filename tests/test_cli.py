"""`rlx validate`: exit status and where the message goes, as users' scripts see them (a subprocess);
each refusal's sentence through the same ``launch.cli.main`` in this process (a process per case
would cost seconds of imports each)."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets  # the session's tiny model and data (tests/conftest.py)


def rlx(*args):
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def rlx_here(capsys, *args) -> subprocess.CompletedProcess:
    """``rlx args`` run by launch.cli.main in this process (from the repository, as `rlx` is run): its
    exit status and what it wrote to stdout and stderr."""
    from launch.cli import main

    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        code = main(list(args))
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_validate_accepts_the_quickstart_and_prints_the_layout(assets):
    model, data = assets
    proc = rlx("validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
               f"data.train_files=[{data}]", f"data.val_files=[{data}]")
    assert proc.returncode == 0, proc.stderr
    assert "valid (cpu profile, 3 GPUs)" in proc.stdout
    assert re.search(r"^actor\s+actor\s+2\s+2\s+1\s+1 *$", proc.stdout, re.M), proc.stdout
    # The reference takes the actor's layout, so its model goes into the actor's processes.
    assert re.search(r"^reference \(in actor\)\s+actor\s+2\s+2\s+1\s+1 *$", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("override,message", [
    ("actor.tpp=2", "unknown key actor.tpp"),
    ("actor.tp=two", "actor.tp='two' has the wrong type, expected an integer"),
    ("resources.pools.actor=3 actor.tp=1 actor.pp=3", "actor.pp=3 does not divide the model's 4 layers"),
    ("rollout.engines=2", "rollout.engines*rollout.tp=2*1=2 does not equal the 1 GPUs of pool 'rollout'"),
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator='ppo' is not one of: gae, grpo, drgrpo, rloo, "
     "reinforce_plus_plus, reinforce_plus_plus_baseline, remax"),
    ("data.train_files=[missing.parquet]", "data.train_files[0]=missing.parquet not found"),
])
def test_validate_rejects_with_one_sentence_on_stderr(assets, override, message, capsys):
    model, data = assets
    proc = rlx_here(capsys, "validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
                    f"data.train_files=[{data}]", f"data.val_files=[{data}]", *override.split())
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_refusal_is_one_line_on_stderr_and_exit_2_as_a_script_sees_it(assets):
    """One of the refusals above through `python -m launch.cli` in its own process: nothing else (an
    import's warning, a log line) reaches either stream."""
    model, data = assets
    proc = rlx("validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
               f"data.train_files=[{data}]", f"data.val_files=[{data}]", "rollout.engines=2")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "rollout.engines*rollout.tp=2*1=2 does not equal the 1 GPUs of pool 'rollout'" in proc.stderr


def test_train_rejects_before_starting_anything(assets, tmp_path):
    model, data = assets
    proc = rlx("train", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}", f"data.train_files=[{data}]",
               f"data.val_files=[{data}]", f"trainer.run_dir={tmp_path / 'run'}", "actor.tp=3")
    assert proc.returncode == 2 and "actor.tp*actor.pp=3*1=3 does not divide" in proc.stderr
    assert not (tmp_path / "run").exists(), "a rejected spec must not create the run folder"


def test_validate_names_a_malformed_data_row(assets, tmp_path, capsys):
    model, _ = assets
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}, '
                   '"data_source": "x"}\n'
                   '{"prompt": "1+2=", "reward_model": {"ground_truth": "3"}, "data_source": "x"}\n')
    proc = rlx_here(capsys, "validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
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
