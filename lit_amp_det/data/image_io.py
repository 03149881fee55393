"""Decoding image files to uint8 RGB tensors, with a PIL fallback and errors that name the file."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor

try:  # deprecated in torchvision 0.29 (moving to TorchCodec); PIL takes over once it is gone
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # pragma: no cover - depends on the installed torchvision
    decode_image = None

__all__ = ["read_rgb_image"]

_TV_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
_ORIENTATION = 0x0112  # the EXIF tag


def read_rgb_image(path: str | Path, apply_exif_orientation: bool = False) -> Tensor:
    """Decode ``path`` to a uint8 ``[3, H, W]`` RGB tensor (torchvision's decoder returns it as a view of
    ``[H, W, 3]`` memory, PIL's path contiguous: the loaders batch either). Uses
    ``torchvision.io.decode_image`` (libjpeg-turbo/libpng: faster than PIL for JPEG, and already
    channel-first), converting greyscale, palette, RGBA and CMYK to RGB. torchvision 0.29 deprecates its
    decoders in favour of TorchCodec, so that one warning is silenced here; formats torchvision does not read
    (BMP, TIFF, ...) and torchvision builds without decoders fall back to PIL. A missing, empty or corrupt
    file raises ``OSError`` naming the path.

    ``apply_exif_orientation``: turn the pixels as the file's EXIF orientation tag says (a phone photo taken
    upright is often stored sideways with such a tag), so the picture is what a viewer shows. Off for
    annotated datasets, whose annotations give the stored size.
    """
    if decode_image is None or (apply_exif_orientation and _exif_orientation(path) not in (None, 1)):
        # PIL turns every format (torchvision's decoder ignores the tag of a WebP)
        return _read_with_pil(path, None, apply_exif_orientation)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_TV_DEPRECATION, category=DeprecationWarning)
            image = decode_image(str(path), mode=ImageReadMode.RGB)
    except RuntimeError as tv_err:
        image = _read_with_pil(path, tv_err, apply_exif_orientation)
    if image.dtype == torch.uint16:  # 16-bit PNG: keep the 8 most significant bits
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    return image


def _exif_orientation(path: str | Path) -> int | None:
    """The EXIF orientation tag (1..8) from the file's header, ``None`` without one or for a file PIL cannot
    open (the decoder then names the problem).
    """
    try:
        with Image.open(path) as pil_image:
            return pil_image.getexif().get(_ORIENTATION)
    except Exception:  # noqa: BLE001 - unreadable here means unreadable for the decoder too, which raises
        return None


def _read_with_pil(
    path: str | Path, tv_err: Exception | None, apply_exif_orientation: bool = False
) -> Tensor:
    """PIL fallback for `read_rgb_image`; raises ``OSError`` naming the file if it fails too."""
    try:
        with Image.open(path) as pil_image:
            turned = ImageOps.exif_transpose(pil_image) if apply_exif_orientation else pil_image
            array = np.array(turned.convert("RGB"))
    except Exception as err:  # PIL raises several unrelated types for bad files
        tv_note = (
            f" (torchvision: {str(tv_err).splitlines()[0]})" if tv_err is not None and str(tv_err) else ""
        )
        raise OSError(
            f"cannot read image {path}: {err}{tv_note}; the file is missing, truncated or not an image -- "
            "re-extract the dataset or remove the image from the annotation file"
        ) from err
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
