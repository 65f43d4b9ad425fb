"""optax.contrib's names: optimizers and transformations from recent papers, with optax's definitions."""

from gradtx.contrib.galore import GaLoreDimensionNumbers, GaLoreState, galore, scale_by_galore

__all__ = ["GaLoreDimensionNumbers", "GaLoreState", "galore", "scale_by_galore"]
