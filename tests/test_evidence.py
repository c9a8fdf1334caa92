"""Evidence in one place (docs/evidence.md): every pointer to it from the product names one
of its sections, and the product's prose names no GPU model outside the architectures'
table, where the figures of one GPU would age."""

import ast
import io
import re
import tokenize

from helpers import REPO

PRODUCT = ("kernel", "tuner", "refs", "reports")
PAGE = REPO / "docs" / "evidence.md"
GPU = re.compile(r"\b(?:[AHB]100|H200|B200|GB200|A800)\b")
POINTER = re.compile(r"docs/evidence\.md#([\w-]+)")
# where prose may name a GPU model, and why
PROSE_HOME = {"kernel/arch.py": "the architectures' table: each one's reference GPUs and their SM counts"}
# where code (a name, a printed string) names one, and why
CODE_HOME = {
    "kernel/arch.py": "the architectures' table lists each one's GPUs",
    "tuner/latency.py": "H200_BANDWIDTH, the shipped model's GPU's copy rate",
    "tuner/cli.py": "imports H200_BANDWIDTH; --bandwidth's help prints its GPU",
    "tuner/commands/model.py": "model fit's default bandwidth, H200_BANDWIDTH",
}


def modules() -> dict[str, str]:
    return {
        str(path.relative_to(REPO)): path.read_text()
        for d in PRODUCT
        for path in sorted((REPO / d).rglob("*.py"))
    }


def prose(source: str) -> str:
    """The comments and docstrings of ``source``."""
    comments = [
        t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT
    ]
    nodes = [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    docstrings = [ast.get_docstring(n, clean=False) or "" for n in nodes]
    return "\n".join(comments + docstrings)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to -."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_prose_finds_comments_and_docstrings_not_code():
    source = '"""Doc H200."""\nX = "H100"  # set on an H200\ndef f():\n    """Its B200."""\n'
    assert GPU.findall(prose(source)) == ["H200", "H200", "B200"]


def test_only_the_architectures_table_names_a_gpu_in_prose():
    named = {name for name, source in modules().items() if GPU.search(prose(source))}
    assert named <= PROSE_HOME.keys(), sorted(named - PROSE_HOME.keys())


def test_only_the_named_modules_name_a_gpu_in_code():
    named = {name for name, source in modules().items() if GPU.search(source)}
    assert named <= CODE_HOME.keys(), sorted(named - CODE_HOME.keys())


def test_every_pointer_to_the_evidence_names_a_section():
    sections = anchors(PAGE.read_text())
    pointers = {(name, anchor) for name, source in modules().items() for anchor in POINTER.findall(source)}
    assert {a for _, a in pointers} >= {"rule-family", "rule-chain", "latency-model"}
    assert {(n, a) for n, a in pointers if a not in sections} == set()


def test_every_section_is_pointed_to_from_the_product():
    pointed = {a for source in modules().values() for a in POINTER.findall(source)}
    assert anchors(PAGE.read_text()) - {"evidence-why-each-measured-constant-has-its-value"} <= pointed
