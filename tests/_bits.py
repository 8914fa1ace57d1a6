"""Bit-exact array comparison for the tests (see ``promptstore._bits``)."""

from promptstore._bits import bits_equal

__all__ = ["bits_equal"]
