"""tuner.options: what a run is asked for, and the shapes flag."""

import dataclasses

import pytest

from tuner import options
from tuner.options import Options, UsageError, parse_shapes


def test_parse_shapes():
    assert parse_shapes("8x16x4096,2x16x16384") == [(8, 16, 4096), (2, 16, 16384)]
    assert parse_shapes("1x2x256,8x16x4096,1x2x256") == [(1, 2, 256), (8, 16, 4096)]  # each once
    for bad in ("1x2", "1x2x0", "axbxc", "", "1x2x3,"):
        with pytest.raises(UsageError, match="--shapes wants BxHxS"):
            parse_shapes(bad)
    with pytest.raises(UsageError, match="--hold-out wants BxHxS"):
        parse_shapes("8x16", "--hold-out")


def test_every_option_has_help_and_a_flag_unless_kept_off_the_command_line():
    flags = {f.name: options.flag(f) for f in options.fields()}
    assert flags["timeout_s"] == "--timeout" and flags["n_trials"] == "--n-trials"
    assert flags["wave_seeds"] == "--no-wave-seeds" and "enqueue" not in flags
    assert all(f.metadata["help"] for f in dataclasses.fields(Options))
    assert Options().n_trials == 40 and Options().sampler in options.SAMPLERS


def test_parse_archs_names_each_architecture_once():
    assert options.parse_archs("sm_90a, sm_80,sm_90a") == ["sm_90a", "sm_80"]
    assert options.parse_archs("all")[0] == "sm_80"
    with pytest.raises(UsageError, match="--arch wants architectures of"):
        options.parse_archs("sm_70")
