"""Typed JSON records (`rundir.JsonRecord`): the fields are the keys in declaration order, an `omitted` field leaves
the object while it is None (any other None is written as null), and `from_json` reads an object or a file back,
nested records included, refusing missing and unknown keys."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest

from dflash_lib.rundir import JsonRecord, omitted


@dataclass
class Part(JsonRecord):
    n: int  # a count
    tags: list[str]  # names


@dataclass
class Report(JsonRecord):
    name: str  # what it is
    eta_s: float | None  # seconds; None is written as null
    part: Part  # one nested record
    parts: list[Part]  # a list of them
    by_key: dict[str, Part]  # a dict of them
    maybe: Part | None  # an optional one
    extra: float | None = omitted()  # left out while None


def _report(**changes) -> Report:
    return replace(Report("a", None, Part(1, ["x"]), [Part(2, [])], {"k": Part(3, ["y", "z"])}, None), **changes)


def test_the_fields_are_the_keys_and_an_omitted_field_leaves_while_none():
    doc = _report().to_json()
    assert doc == {"name": "a", "eta_s": None, "part": {"n": 1, "tags": ["x"]}, "parts": [{"n": 2, "tags": []}],
                   "by_key": {"k": {"n": 3, "tags": ["y", "z"]}}, "maybe": None}
    assert list(doc) == ["name", "eta_s", "part", "parts", "by_key", "maybe"]
    assert list(_report(extra=0.5).to_json())[-1] == "extra" and _report(extra=0.0).to_json()["extra"] == 0.0
    assert json.loads(json.dumps(doc)) == doc  # plain JSON: no record object left inside


def test_from_json_reads_an_object_or_a_file_back_nested_records_included(tmp_path):
    rec = _report(maybe=Part(4, ["w"]), extra=0.5)
    back = Report.from_json(json.loads(json.dumps(rec.to_json())))
    assert back == rec and isinstance(back.part, Part) and isinstance(back.by_key["k"], Part)
    assert isinstance(back.maybe, Part) and all(isinstance(p, Part) for p in back.parts)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report().to_json()))
    assert Report.from_json(path) == Report.from_json(str(path)) == _report()  # extra absent: None


def test_from_json_refuses_missing_and_unknown_keys_naming_them(tmp_path):
    doc = _report().to_json()
    del doc["name"], doc["eta_s"]  # (a null is not a missing key: eta_s must be there)
    doc["bogus"] = 1
    with pytest.raises(ValueError, match=r"^not a Report: missing keys \['eta_s', 'name'\]; unknown keys \['bogus'\]$"):
        Report.from_json(doc)
    with pytest.raises(ValueError, match=r"^Report\.parts: not a Part: missing keys \['tags'\]$"):
        Report.from_json({**_report().to_json(), "parts": [{"n": 1}]})
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"^{path}: a Report is a JSON object, got list$"):
        Report.from_json(path)
