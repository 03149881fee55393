"""lit_amp_det: fast, memory-lean Mask R-CNN training and inference as PyTorch Lightning plugins.

Public entry points: :class:`MaskRCNNModule` (subclass it in research code), the data modules, and the
task functions :func:`train`, :func:`validate`, :func:`test`, :func:`predict` that the CLI runs.
Importing the package builds nothing and downloads nothing.
"""

from lit_amp_det.module import MaskRCNNModule
from lit_amp_det.tasks import predict, test, train, validate

__all__ = ["MaskRCNNModule", "train", "validate", "test", "predict", "__version__"]

__version__ = "0.1.0"
