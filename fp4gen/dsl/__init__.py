"""The recipe language: parse .fp4r text into the Recipe model and print it back."""

from fp4gen.dsl.parser import load_recipe, parse_recipe
from fp4gen.dsl.printer import print_recipe
from fp4gen.dsl.source import find_recipe

__all__ = ["find_recipe", "load_recipe", "parse_recipe", "print_recipe"]
