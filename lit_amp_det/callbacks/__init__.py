"""Lightning callbacks shipped with lit_amp_det (a module per callback, a YAML each in conf/callbacks/)."""

from lit_amp_det.callbacks.console_log import ConsoleLog
from lit_amp_det.callbacks.conv_bn_eval import ConvBNEval
from lit_amp_det.callbacks.cuda_graph import CUDAGraphTraining
from lit_amp_det.callbacks.freeze_norm import FreezeNorm
from lit_amp_det.callbacks.last_checkpoint import LastCheckpoint, RunInterrupted
from lit_amp_det.callbacks.memory_monitor import MemoryMonitor
from lit_amp_det.callbacks.prediction_writer import CocoPredictionWriter
from lit_amp_det.callbacks.rng_state import RNGStateCheckpoint
from lit_amp_det.callbacks.throughput import Throughput
from lit_amp_det.callbacks.training_curves import TrainingCurves
from lit_amp_det.callbacks.validation_images import ValidationImages

__all__ = [
    "CocoPredictionWriter",
    "ConsoleLog",
    "ConvBNEval",
    "CUDAGraphTraining",
    "FreezeNorm",
    "LastCheckpoint",
    "MemoryMonitor",
    "RNGStateCheckpoint",
    "RunInterrupted",
    "Throughput",
    "TrainingCurves",
    "ValidationImages",
]
