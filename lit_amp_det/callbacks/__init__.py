"""Lightning callbacks shipped with lit_amp_det (one module per callback)."""

from lit_amp_det.callbacks.prediction_writer import CocoPredictionWriter
from lit_amp_det.callbacks.rng_state import RNGStateCheckpoint

__all__ = ["CocoPredictionWriter", "RNGStateCheckpoint"]
