"""tuner.storage: study names, storages, and the trials a killed run left running."""

import json
import os
import socket

import optuna
import pytest
from helpers import SMALL_PROBLEM

from kernel import Problem
from tuner.options import UsageError
from tuner.storage import default_study_name, fail_interrupted, get_storage, load_study, open_study


def test_default_study_name_is_the_problem():
    assert default_study_name(SMALL_PROBLEM) == "b1-h2-s256-dk64-dv64-a0.99-float16"
    assert json.loads(json.dumps(SMALL_PROBLEM.to_dict())) == SMALL_PROBLEM.to_dict()


def test_a_study_keeps_its_problem(tmp_path):
    storage = f"sqlite:///{tmp_path / 'sub' / 'db.sqlite'}"  # the folder is made
    study = open_study(SMALL_PROBLEM, name="s", storage=storage)
    assert study.user_attrs["problem"] == SMALL_PROBLEM.to_dict()
    assert open_study(SMALL_PROBLEM, name="s", storage=storage).study_name == "s"  # resumed
    with pytest.raises(UsageError, match="study 's' was made for"):
        open_study(Problem(2, 2, 256, 64, 64, 0.99), name="s", storage=storage)
    with pytest.raises(UsageError, match="no study 'other' in"):
        load_study("other", storage)
    with pytest.raises(UsageError, match="cannot open storage 'nosuchdb://x'"):
        get_storage("nosuchdb://x")


def test_trials_of_a_dead_process_are_marked_interrupted(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'db.sqlite'}")
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    for pid in (dead, os.getpid()):  # a process that is gone, and this live one
        trial = study.ask()
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", pid)
    assert fail_interrupted(study) == 1
    first, second = study.get_trials()
    assert first.state == optuna.trial.TrialState.FAIL and first.user_attrs["status"] == "interrupted"
    assert f"process {dead} died" in first.user_attrs["reason"]
    assert second.state == optuna.trial.TrialState.RUNNING
