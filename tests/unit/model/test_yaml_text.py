"""YAML this project writes for kubectl and Helm quotes the strings Go's parser would read as
numbers or booleans (`continuum_operator.yaml_text`); PyYAML alone does not. The e2e
`test_yaml_text_kubectl.py` shows kubectl reading both back."""

from __future__ import annotations

import yaml
from hypothesis import given
from hypothesis import strategies as st

from continuum_operator import yaml_text

# Strings go-yaml reads as a float or a bool that PyYAML writes plain.
GO_NON_STRINGS = ["85979e45", "1e5", "1.0e5", "1E-3", ".5e2", "y", "Y", "n", "N"]


def test_pyyaml_alone_writes_them_plain_so_kubectl_would_read_numbers() -> None:
    for text in GO_NON_STRINGS:
        assert yaml.safe_dump({"v": text}) == f"v: {text}\n"


def test_they_are_quoted_and_read_back_as_the_same_strings() -> None:
    doc = {"metadata": {"labels": {f"k{i}": t for i, t in enumerate(GO_NON_STRINGS)}}}
    text = yaml_text.dump(doc)
    for t in GO_NON_STRINGS:
        assert f"'{t}'" in text
    assert yaml.safe_load(text) == doc


def test_numbers_stay_numbers_and_plain_words_stay_plain() -> None:
    text = yaml_text.dump({"count": 3, "x": 1e5, "name": "coder", "hex": "a85979e4"})
    assert "count: 3\n" in text and "name: coder\n" in text and "hex: a85979e4\n" in text
    assert yaml.safe_load(text)["x"] == 1e5


@given(
    st.lists(st.dictionaries(st.text(min_size=1), st.one_of(st.text(), st.integers())), max_size=3)
)
def test_every_document_reads_back_unchanged(docs: list[dict[str, object]]) -> None:
    assert list(yaml.safe_load_all(yaml_text.dump_all(docs))) == docs
