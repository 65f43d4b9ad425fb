"""Combinators that build transformations out of transformations."""

from gradtx.chains.chain import chain, named_chain

__all__ = ["chain", "named_chain"]
