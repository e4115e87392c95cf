"""launch/compose.py start_roles: the roles of a job start side by side; one that fails to start
takes the others down and its error is the one raised. load_while_ray_starts: the task loads while
Ray starts."""
import threading
from types import SimpleNamespace

import pytest

from launch.compose import start_roles


class Started:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def shutdown(self):
        self.log.append(f"shutdown {self.name}")


def test_every_role_is_started_at_once_and_returned_by_name():
    # Each maker waits until all three are inside their constructors: one after the other would time out.
    inside = threading.Barrier(3, timeout=10)
    log = []

    def make(name):
        def start():
            inside.wait()
            return Started(name, log)
        return start

    roles = start_roles({name: make(name) for name in ("actor", "reference", "rollout")})
    assert list(roles) == ["actor", "reference", "rollout"]
    assert [r.name for r in roles.values()] == ["actor", "reference", "rollout"] and log == []


def test_a_role_that_fails_to_start_shuts_the_others_down_and_the_first_failure_is_raised():
    log = []
    reference_failed = threading.Event()

    def actor():
        reference_failed.wait(10)  # still starting when the reference fails: shut down once it is up
        return Started("actor", log)

    def reference():
        reference_failed.set()
        raise RuntimeError("reference rank 0 could not load model.safetensors")

    def rollout():
        raise ValueError("rollout: the engine did not start")

    with pytest.raises(RuntimeError, match="reference rank 0 could not load"):
        start_roles({"actor": actor, "reference": reference, "rollout": rollout, "critic": lambda: Started("critic", log)})
    assert sorted(log) == ["shutdown actor", "shutdown critic"]


def test_the_task_loads_while_ray_starts_and_its_error_comes_once_ray_is_up(monkeypatch):
    """launch/compose.py load_while_ray_starts: the task's loading and Ray's start-up overlap (each waits
    here for the other to be under way: one after the other would time out); a bad row's error is the
    one raised, after Ray is up (the caller shuts it down) and before any role could start."""
    import launch.compose as compose
    from rlcore.data import DataError

    both_inside = threading.Barrier(2, timeout=10)
    events = []

    def start_ray(*args):
        both_inside.wait()
        events.append("ray up")

    monkeypatch.setattr(compose, "start_ray", start_ray)
    cfg, layout = SimpleNamespace(resources=SimpleNamespace(ray_address=None, num_cpus=2)), \
        SimpleNamespace(device="cpu", total_gpus=2)

    def load():
        both_inside.wait()
        return "task"

    assert compose.load_while_ray_starts(load, cfg, layout) == "task" and events == ["ray up"]

    def bad_row():
        both_inside.wait()
        raise DataError("train.parquet row 3: 'prompt' must be a string")

    events.clear()
    with pytest.raises(DataError, match="row 3"):
        compose.load_while_ray_starts(bad_row, cfg, layout)
    assert events == ["ray up"]
