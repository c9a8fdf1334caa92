"""The lab (``experiments/``) may be deleted without the product or its tests noticing:
nothing in them reads a path under it (they may cite it in prose), and the tests of what
is fitted from GPU data pass in a copy of the tree without it."""

import io
import os
import shutil
import subprocess
import sys
import tokenize

import pytest
from helpers import REPO

CODE = ("kernel", "tuner", "refs", "reports", "tests")
# the files that may name a lab path, and why
EXCEPTIONS = {"tests/test_lab_optional.py": "names the lab to find it and to leave it out"}


def lab_paths(source: str) -> list[str]:
    """The string literals of ``source`` that name a path in the lab (docstrings are prose)."""
    found, previous = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        text = None
        if tok.type == tokenize.STRING and previous not in (
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
        ):
            text = tok.string.lstrip("rbuRBUfF").strip("'\"")
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            text = tok.string
        if text is not None and (
            text == "experiments" or text.startswith(("experiments/", "../experiments"))
        ):
            found.append(f"{tok.start[0]}: {tok.string}")
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return found


def test_lab_paths_finds_a_path_and_not_prose():
    assert lab_paths('P = REPO / "experiments" / "shipped"\n') == ['1: "experiments"']
    assert lab_paths('f = open("experiments/shipped/x.jsonl")\n') == ['1: "experiments/shipped/x.jsonl"']
    assert lab_paths('"""Why: experiments/shipped/README.md."""\nx = 1  # experiments/few/\n') == []
    assert lab_paths('raise ValueError("re-tune it (experiments/shipped)")\n') == []


def test_no_product_module_or_test_reads_the_lab():
    reads = {
        str(path.relative_to(REPO)): found
        for folder in CODE
        for path in sorted((REPO / folder).rglob("*.py"))
        if (found := lab_paths(path.read_text()))
    }
    assert reads.keys() == EXCEPTIONS.keys(), reads


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs the git checkout"
)
def test_the_fitted_product_s_tests_pass_in_a_tree_without_the_lab(tmp_path):
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in files.splitlines():
        if not name.startswith("experiments/") and (REPO / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tmp_path / name)
    assert not (tmp_path / "experiments").exists()
    where = "tests/test_lab_optional.py::test_the_copy_imports_itself"
    tests = [
        where,
        "tests/test_fit_data.py",
        "tests/test_latency.py::test_the_shipped_model_is_what_model_fit_makes_of_the_package_s_sweeps",
    ]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-s", "-p", "no:cacheprovider", *tests],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and str(tmp_path) in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_the_copy_imports_itself():
    """In the copy above: the product it imports is the copy's, not the checkout's."""
    import tuner

    print(tuner.__file__)
    assert (REPO / "tuner" / "__init__.py").samefile(tuner.__file__)
