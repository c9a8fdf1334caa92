"""Evidence in one place (docs/evidence.md): every pointer to it from the product names one
of its sections, and the product names no GPU model, in prose, a string or an identifier,
outside the architectures' registry, where the numbers of one GPU would age."""

import ast
import io
import re
import tokenize

from helpers import REPO

PRODUCT = ("kernel", "tuner", "refs", "reports")
PAGE = REPO / "docs" / "evidence.md"
GPU = re.compile(r"\b(?:[AHB]100|H200|B200|GB200|A800)\b")
# a GPU model as part of a name, in any case: H200_BANDWIDTH, h100_rate, bandwidthH200
GPU_IN_NAME = re.compile(r"(?<!\d)(?:[AHB]100|H200|B200|A800)(?!\d)", re.IGNORECASE)
POINTER = re.compile(r"docs/evidence\.md#([\w-]+)")
# The one module that names GPU models, in prose and in code, and why: what a constant's
# numbers came from lives in docs/evidence.md, and a name says what the constant is.
GPU_HOME = {"kernel/arch.py": "the architectures' registry: each one's reference GPUs and their SM counts"}


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


def identifiers(source: str) -> set[str]:
    """The names in ``source``: its variables, functions, classes, attributes and keywords."""
    return {
        t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NAME
    }


def names_a_gpu(source: str) -> bool:
    """Whether ``source`` names a GPU model: in its text (prose, strings) or in a name."""
    return bool(GPU.search(source)) or any(GPU_IN_NAME.search(n) for n in identifiers(source))


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to -."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_prose_finds_comments_and_docstrings_not_code():
    source = '"""Doc H200."""\nX = "H100"  # set on an H200\ndef f():\n    """Its B200."""\n'
    assert GPU.findall(prose(source)) == ["H200", "H200", "B200"]


def test_a_gpu_in_a_name_is_found_and_a_number_alone_is_not():
    for named in ("H200_BANDWIDTH = 4.22e12", "h100_rate = 1", "def bandwidth_of_b200(): ...", "x.onA100"):
        assert names_a_gpu(named), named
    for clean in (
        "MODEL_BANDWIDTH = 4.22e12",
        'arch = "sm_100a"',
        "rows = 1100",
        "kh2001 = 1",
        "'-h100.jsonl'",
    ):
        assert not names_a_gpu(clean), clean


def test_only_the_architectures_table_names_a_gpu_in_prose():
    named = {name for name, source in modules().items() if GPU.search(prose(source))}
    assert named == GPU_HOME.keys()


def test_only_the_architectures_table_names_a_gpu_in_code():
    named = {name for name, source in modules().items() if names_a_gpu(source)}
    assert named == GPU_HOME.keys()


def test_every_pointer_to_the_evidence_names_a_section():
    sections = anchors(PAGE.read_text())
    pointers = {(name, anchor) for name, source in modules().items() for anchor in POINTER.findall(source)}
    assert {a for _, a in pointers} >= {"rule-family", "rule-chain", "latency-model"}
    assert {(n, a) for n, a in pointers if a not in sections} == set()


def test_every_section_is_pointed_to_from_the_product():
    pointed = {a for source in modules().values() for a in POINTER.findall(source)}
    assert anchors(PAGE.read_text()) - {"evidence-why-each-measured-constant-has-its-value"} <= pointed
