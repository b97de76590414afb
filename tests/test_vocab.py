"""One vocabulary (fp4gen.vocab): the grammar, the parser's messages, the formats, the kernel
specs and the kernel modules spell rounding modes, archs, directions and dtypes as the enums do."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch

from fp4gen import formats, spec, vocab
from fp4gen.dsl import parse_recipe
from fp4gen.dsl.syntax_errors import _ENUMS
from fp4gen.errors import RecipeError
from fp4gen.numerics import minifloat
from fp4gen.vocab import DTYPES, Arch, Direction, Rounding, ScaleRounding, words

GRAMMAR = Path(vocab.__file__).resolve().parent / "dsl" / "grammar.lark"


def terminal_words(name: str) -> set[str]:
    """The words of a grammar terminal defined as alternatives of string literals."""
    match = re.search(rf"^{name}\s*:(.*)$", GRAMMAR.read_text(), re.M)
    assert match is not None, f"no terminal {name} in the grammar"
    return set(re.findall(r'"([^"]*)"', match.group(1)))


@pytest.mark.parametrize(
    ("terminal", "enum"), [("ELEM_ROUND", Rounding), ("SCALE_ROUND", ScaleRounding)]
)
def test_grammar_and_messages_spell_the_enums(terminal: str, enum: type[vocab.StrEnum]) -> None:
    assert terminal_words(terminal) == set(words(enum))
    assert _ENUMS[terminal] == words(enum)


def test_a_wrong_rounding_lists_the_enum() -> None:
    with pytest.raises(RecipeError) as err:
        parse_recipe("recipe x\noperands {\n  * : nvfp4 round sideways\n}\n")
    listed = re.findall(r"'([a-z0-9]+)'", str(err.value).splitlines()[0])
    assert [w for w in listed if w != "sideways" and w != "round"] == list(words(Rounding))


def test_literal_types_agree_with_the_enums() -> None:
    assert typing.get_args(formats.ElementRounding) == words(Rounding)
    assert typing.get_args(formats.ScaleRounding) == words(ScaleRounding)
    assert words(Rounding) == formats.ELEMENT_ROUNDINGS
    assert words(ScaleRounding) == formats.SCALE_ROUNDINGS
    assert typing.get_args(minifloat.Rounding) == words(Rounding)
    assert typing.get_args(spec.Direction) == words(Direction)
    assert typing.get_args(spec.InputDType) == tuple(DTYPES)
    assert tuple(DTYPES) == formats.HIGH_PRECISION_DTYPES
    assert set(spec.ROUNDING_TAGS) == set(words(Rounding))
    assert all(type(k) is str for k in spec.ROUNDING_TAGS)  # plain words: names and keys


def test_stochastic_bits() -> None:
    bits = {r: formats.sr_bits(r) for r in Rounding}
    assert bits == {
        "nearest": 0,
        "stochastic": 32,
        "stochastic16": 16,
        "stochastic8": 8,
        "zero": 0,
    }


def test_archs_are_the_enums_words() -> None:
    from fp4gen.codegen import dequant, gemm, mor
    from fp4gen.compiler import jit

    assert words(Arch) == jit.ARCHS
    for module in (dequant, gemm, mor):
        assert set(module.ARCHS) <= set(words(Arch)), module.__name__
        assert all(type(a) is str for a in module.ARCHS)


def test_str_enum_members_are_their_words() -> None:
    assert Rounding.NEAREST == "nearest"
    assert f"{Arch.SM100A}" == "sm_100a" == str(Arch.SM100A)
    assert "columnwise" in set(Direction)


def test_dtype_table() -> None:
    for name, dtype in DTYPES.items():
        assert dtype.torch.itemsize == dtype.size
        assert vocab.dtype_name(dtype.torch) == name
    assert vocab.dtype_name(torch.int8) is None
    assert [d.cute for d in DTYPES.values()] == ["BFloat16", "Float16", "Float32"]
