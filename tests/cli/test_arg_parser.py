"""The command-line grammar: parsing, merging overrides, deleting keys, $(...) references, typing."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import pytest

from nnscaler.cli.arg_parser import (
    _fix_type,
    _KeyNotFoundError,
    deserialize_dataclass,
    merge_args,
    parse_args,
    resolve_args,
)
from nnscaler.errors import ConfigError


@dataclass
class Leaf:
    h: int


@dataclass
class Pair:
    d: int
    e: int


@dataclass
class Branch:
    g: Leaf


@dataclass
class Root:
    a: int
    b: bool
    c: Pair
    f: Branch
    h: tuple[int, ...] = None
    g: list[str] = None
    k: list[int] = None
    w: dict[str, int] = None
    v: dict[str, int] = None
    x: dict[str, Any] = None
    y: list[Branch] = None
    z: dict[str, Any] = None


@dataclass
class Lists:
    a: list[int] = field(default_factory=list)
    b: list[Leaf] = field(default_factory=list)
    c: tuple[int, ...] = None


def test_parse_forms_nest_and_dashes():
    assert parse_args(["--a-good=1", "--b", "2", "--c.d=3", "--c.e", "4", "--f.g.h=5"]) == {
        "a_good": "1",
        "b": "2",
        "c": {"d": "3", "e": "4"},
        "f": {"g": {"h": "5"}},
    }
    assert parse_args(["--a=1", "--flag", "--c.d=3"]) == {"a": "1", "flag": None, "c": {"d": "3"}}
    assert parse_args(["--b", "[1,2,3]"]) == {"b": "[1,2,3]"}


def test_parse_rejects_a_stray_value():
    with pytest.raises(ValueError, match="'e'"):
        parse_args(["--a=1", "e", "--b"])
    with pytest.raises(ValueError, match="--a"):
        parse_args(["--a=1", "--a.b=2"])


def test_fix_type():
    assert _fix_type(int) is int
    assert _fix_type(None) is None
    assert _fix_type(Any) is None
    assert _fix_type(Optional[bool]) is bool  # noqa: UP045
    assert _fix_type(bool | None) is bool
    assert _fix_type(list[str], False) == list[str]
    assert _fix_type(Optional[list[str]], False) == list[str]  # noqa: UP045
    assert _fix_type(list[str] | None, False) == list[str]
    with pytest.raises(ValueError):
        _fix_type(list[str], True)
    assert _fix_type(Union[bool, int]) is None
    assert _fix_type(bool | int | None) is None


def test_deserialize_nested_flags_and_collections():
    args = ["--a=1", "--b", "--c.d=3", "--c.e", "4", "--f.g.h=5", "--v.a=10", "--v.b=20", "--k=[10,12]"]
    got = deserialize_dataclass(parse_args(args), Root)
    assert got == Root(a=1, b=True, c=Pair(3, 4), f=Branch(Leaf(5)), k=[10, 12], v={"a": 10, "b": 20})
    args[1:2] = ["--b", "False"]
    assert deserialize_dataclass(parse_args(args), Root).b is False


def test_unknown_fields_are_named_with_a_suggestion():
    base = ["--b", "0", "--c.d=3", "--c.e", "4"]
    with pytest.raises(ConfigError, match=r"f\.g\.hh.*did you mean 'h'"):
        deserialize_dataclass(parse_args(["--a=1", *base, "--f.g.hh=5"]), Root)
    with pytest.raises(ConfigError, match="unknowna"):
        deserialize_dataclass(parse_args(["--unknowna=1", *base, "--f.g.h=5"]), Root)


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"c\.d: expected int, got 'three'"):
        deserialize_dataclass(parse_args(["--a=1", "--b", "--c.d=three", "--c.e=4", "--f.g.h=5"]), Root)
    with pytest.raises(ConfigError, match="b: expected bool"):
        deserialize_dataclass(parse_args(["--a=1", "--b=maybe", "--c.d=3", "--c.e=4", "--f.g.h=5"]), Root)


def test_untyped_values_are_guessed_and_type_keys_kept():
    args = parse_args(
        ["--a=1", "--b", "0", "--c.d=3", "--c.e", "4", "--f.g.h=5", "--v.a=10", "--v.b=20"]
        + ["--z.__type=tests.cli.test_arg_parser.Leaf", "--z.h=6", "--z.y=hello", "--z.x=True"]
        + ["--z.array=[1,2,3]", "--z.badarray=[1,b]", '--z.dict={"a": 1}', "--z.baddict={a:1}"]
        + ["--z.nest.__type=tests.cli.test_arg_parser.Leaf", "--z.nest.h=7"]
    )
    got = deserialize_dataclass(args, Root)
    assert got.b is False
    assert got.z == {
        "__type": "tests.cli.test_arg_parser.Leaf",
        "h": 6,
        "y": "hello",
        "x": True,
        "array": [1, 2, 3],
        "badarray": "[1,b]",
        "dict": {"a": 1},
        "baddict": "{a:1}",
        "nest": {"__type": "tests.cli.test_arg_parser.Leaf", "h": 7},
    }
    assert deserialize_dataclass(asdict(got), Root) == got


def test_list_items_by_index():
    got = deserialize_dataclass(
        parse_args(["--a.0=1", "--a.1=2", "--b.0.h=3", "--b.1.h=4", "--c.1=4"]), Lists
    )
    assert got == Lists(a=[1, 2], b=[Leaf(3), Leaf(4)], c=(None, 4))


def test_union_and_value_type_are_guessed():
    @dataclass
    class U:
        p: Union[str, dict[str, str], None] = None
        q: Any = None

    assert deserialize_dataclass(parse_args(["--p=hello"]), U).p == "hello"
    assert deserialize_dataclass(parse_args(["--p.a=1", "--p.b=b"]), U).p == {"a": 1, "b": "b"}
    assert deserialize_dataclass(parse_args(["--q.__value_type=int", "--q.value=1"]), U).q == {
        "__value_type": "int",
        "value": "1",
    }
    assert deserialize_dataclass(parse_args(["--q.value=1"]), U).q == {"value": 1}


def test_merge_into_lists():
    base = asdict(deserialize_dataclass(parse_args(["--a.0=1", "--a.1=2", "--b.1.h=4"]), Lists))
    assert base == {"a": [1, 2], "b": [None, {"h": 4}], "c": None}
    z = copy.deepcopy(base)
    merge_args(z, ["--a.2=3", "--b.0.h=3", "--b.2.h=5"])
    assert z["a"] == [1, 2, "3"] and z["b"] == [{"h": "3"}, {"h": 4}, {"h": "5"}]
    assert deserialize_dataclass(z, Lists) == Lists(a=[1, 2, 3], b=[Leaf(3), Leaf(4), Leaf(5)])
    z = copy.deepcopy(base)
    merge_args(z, ["--a.3=4", "--b=6"])
    assert z["a"] == [1, 2, None, "4"] and z["b"] == "6"
    z = copy.deepcopy(base)
    merge_args(z, ["--b.1.g=5"])
    assert z["b"] == [None, {"h": 4, "g": "5"}]


@pytest.mark.parametrize(
    "overrides, expected_b",
    [
        (["--b.0.h=3", "--b.1.h!", "--b.2.h!"], [{"h": "3"}, {}, {}]),
        (["--b!", "--b.2.h!"], {"2": {}}),
        (["--b!", "--b.2.h=3"], {"2": {"h": "3"}}),
        (["--b.1.h!", "--b.1.h=3"], [None, {"h": "3"}]),
        (["--b.0.h=3", "--b.1.h!", "--b.2.h=3", "--b.2.h!", "--b.2.g=3"], [{"h": "3"}, {}, {"g": "3"}]),
        (["--b.1!", "--b.2!", "--b.3.h=3", "--b.4!"], [None, None, None, {"h": "3"}]),
    ],
)
def test_delete_keys(overrides, expected_b):
    z = {"a": [1, 2], "b": [None, {"h": 4}]}
    merge_args(z, ["--a.2=3", *overrides])
    assert z == {"a": [1, 2, "3"], "b": expected_b}


def test_deleted_then_rebuilt_list_deserializes():
    z = {"a": [1, 2], "b": [None, {"h": 4}]}
    merge_args(z, ["--b!", "--b.2.h=3"])
    assert deserialize_dataclass(z, Lists) == Lists(a=[1, 2], b=[None, None, Leaf(3)])


def test_resolve_references(monkeypatch):
    monkeypatch.setenv("NNSCALER_TEST_ENV_VAR", "20")
    data = {
        "a": 1,
        "c": {"d": 3, "e": 4},
        "f": {"g": {"h": 5}},
        "v": {"b": "$(NNSCALER_TEST_ENV_VAR)"},
        "x": {"y": "$(c.d)", "z": "$(k.2.y)"},
        "k": ["$(f.g.h)", {"x": 20}, {"y": "$(c.e)"}],
        "l": "${c}",
    }
    resolve_args(data)
    assert data["v"] == {"b": "20"}
    assert data["x"] == {"y": 3, "z": 4}
    assert data["k"] == [5, {"x": 20}, {"y": 4}]
    assert data["l"] == {"d": 3, "e": 4} and data["l"] is not data["c"]


def test_resolve_inside_strings_and_escapes():
    data = {
        "b": "$(k)",
        "c": {"d": 3, "e": 4},
        "x": {"y": "$(c.d)"},
        "k": [5, {"y": "$(c.e)"}],
        "m": "${k.0}1",
        "n": "${m}2$(x.y)",
        "o": r"$\{k.0}1$(x.y)2$\(x.y)",
    }
    resolve_args(data)
    assert data["b"] == [5, {"y": 4}]
    assert data["m"] == "51" and data["n"] == "5123"
    assert data["o"] == "${k.0}132$(x.y)"


def test_circular_and_missing_references():
    with pytest.raises(ValueError, match="circular"):
        resolve_args({"c": {"e": "$(k.1.y)"}, "k": [10, {"y": "$(c.e)"}]})
    with pytest.raises(ValueError, match="circular"):
        resolve_args({"c": {"e": "$(c.e)"}})
    with pytest.raises(_KeyNotFoundError, match=r"k\.2\.y"):
        resolve_args({"c": {"e": "$(k.2.y)"}})
