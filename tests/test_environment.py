"""kernel.environment: the kernels' identity is their code."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernel.environment import KERNEL_MODULES, code_digest, environment, kernel_key

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernel"


def _sources() -> dict[str, str]:
    return {name: (KERNEL_DIR / name).read_text() for name in KERNEL_MODULES}


def _edited(name: str, old: str, new: str) -> dict[str, str]:
    sources = _sources()
    assert sources[name].count(old) == 1, f"{old!r} must occur once in {name}"
    sources[name] = sources[name].replace(old, new)
    return sources


@pytest.mark.parametrize(
    "name,old,new",
    [
        # a comment
        ("scalar_decay.py", "# TileLang's consumer warpgroups", "# the consumers' warpgroups"),
        # the module docstring, a function docstring and a blank line
        ("seq_split.py", '"""The sequence-split variant', '"""The split variant, reworded:'),
        ("variants.py", "in launch order.", "in the order they launch."),
        ("config.py", "\n\ndef knob_choices", "\n\n\ndef knob_choices"),
        # the same code, formatted differently
        ("scalar_decay.py", "max(threads // 128, 1)", "max((threads // 128), (1))"),
    ],
)
def test_prose_and_formatting_keep_the_kernel_key(name, old, new):
    assert kernel_key(_edited(name, old, new)) == kernel_key()


@pytest.mark.parametrize(
    "name,old,new",
    [
        ("scalar_decay.py", "max(threads // 128, 1)", "max(threads // 64, 1)"),  # a constant
        ("seq_split.py", "CARRY_THREADS = 128", "CARRY_THREADS = 256"),
        # an expression
        ("variants.py", "segment_count(problem.seqlen) > 2", "segment_count(problem.seqlen) > 1"),
        (
            "config.py",
            "math.ceil(math.ceil(seqlen / segments) / chunk) * chunk",
            "math.ceil(seqlen / segments)",
        ),
    ],
)
def test_a_changed_constant_or_expression_changes_the_kernel_key(name, old, new):
    assert kernel_key(_edited(name, old, new)) != kernel_key()


def test_only_docstrings_are_dropped_not_other_strings():
    assert code_digest('def f():\n    """doc"""\n    return 1\n') == code_digest("def f():\n    return 1\n")
    assert code_digest('def f():\n    x = "smem"\n') != code_digest('def f():\n    x = "regs"\n')
    assert code_digest('"""only a docstring"""\n') == code_digest("")


def _key_under(python: str) -> tuple[str, str] | None:
    """(version, kernel_key) computed by another interpreter, or None where it does not run."""
    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('e', sys.argv[1]); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); print(sys.version.split()[0], m.kernel_key())"
    )
    run = subprocess.run(
        [python, "-c", code, str(KERNEL_DIR / "environment.py")], capture_output=True, text=True
    )
    return tuple(run.stdout.split()) if run.returncode == 0 else None  # type: ignore[return-value]


def test_the_kernel_key_is_the_same_under_every_python():
    """A table tuned under Python 3.12 is served under 3.11: ``ast.dump``'s text differs
    between versions (3.12 adds ``type_params``, 3.13 drops empty fields), the key must not."""
    pythons = {str(p) for p in Path.home().glob(".pyenv/versions/*/bin/python3")}
    pythons |= {w for n in range(9, 15) if (w := shutil.which(f"python3.{n}"))}
    keys = dict(k for p in sorted(pythons) if (k := _key_under(p)))
    keys.pop(sys.version.split()[0], None)
    if not keys:
        pytest.skip("no other Python interpreter on this machine")
    assert keys == dict.fromkeys(keys, kernel_key())


def test_a_field_a_python_adds_empty_keeps_the_digest(monkeypatch):
    """What 3.12 did to every function (a new field, ``type_params``, empty), simulated on
    any Python with a field no version has: the digest's text is unchanged while the field
    is empty, and changes once it holds something."""
    from kernel.environment import _dump

    tree = ast.parse("def f(x):\n    return x\n")
    before = _dump(tree)
    monkeypatch.setattr(ast.FunctionDef, "_fields", (*ast.FunctionDef._fields, "later_field"))
    tree.body[0].later_field = []
    assert _dump(tree) == before
    tree.body[0].later_field = [ast.Name("y")]
    assert _dump(tree) != before


def test_environment_names_the_kernel_and_the_stack():
    env = environment()
    assert env["kernel"] == kernel_key() and len(env["kernel"]) == 12
    assert env["tilelang"] and env["torch"]
