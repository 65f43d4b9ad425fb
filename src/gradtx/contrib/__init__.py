"""optax.contrib's names: optimizers and transformations from recent papers, with optax's definitions."""

from gradtx.contrib.muon import MuonDimensionNumbers, MuonState, muon, scale_by_muon

__all__ = ["MuonDimensionNumbers", "MuonState", "muon", "scale_by_muon"]
