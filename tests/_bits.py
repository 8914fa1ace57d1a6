"""Bit-exact array comparison for the tests (see ``promptstore.format._bits``)."""

from promptstore.format._bits import bits_equal

__all__ = ["bits_equal"]
