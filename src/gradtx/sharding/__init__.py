"""Sharding specs: how each gradient leaf is laid out across ranks, and the exact reductions."""
