"""A uint8 tensor over a decoded ``PIL.Image``'s own pixel memory, without the copy ``np.asarray`` makes.

Pillow keeps an RGB image as 4 bytes per pixel (R, G, B, pad) and exports that memory through the Arrow
C data interface (``__arrow_c_array__``: a fixed-size list of 4 uint8 per pixel, zero-copy, one memory
block). ``rgb_view`` reads the two C structs the Arrow spec fixes, checks every field it relies on,
and returns ``[1, 4, H, W]`` (channels-last strides; channel 3 is padding) with the capsule that owns
the memory. Anything unexpected — another layout, an image in several blocks, an older Pillow — gives
``[1, 3, H, W]`` over a copy instead (``np.asarray``). Callers use only channels ``[:3]``.
"""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import torch
from PIL import Image

# ``np.asarray(pil_image)`` is a read-only view of a fresh buffer that only the caller reads; copying it
# to make it writable would cost a pass over the image for nothing, so torch's one-time warning goes.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class _ArrowSchema(ctypes.Structure):
    pass


class _ArrowArray(ctypes.Structure):
    pass


_ArrowSchema._fields_ = [  # Arrow C data interface, struct ArrowSchema
    ("format", ctypes.c_char_p),
    ("name", ctypes.c_char_p),
    ("metadata", ctypes.c_char_p),
    ("flags", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowSchema))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]
_ArrowArray._fields_ = [  # struct ArrowArray
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def rgb_view(img: Image.Image) -> tuple[torch.Tensor, object]:
    """``([1, C, H, W] uint8, keepalive)`` over ``img``'s pixels: C = 4 zero-copy, or 3 over a copy.

    The tensor is valid while ``keepalive`` (and ``img``) live; nothing may write to it."""
    if img.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {img.mode!r}")
    arr, keep = _rgbx_array(img)
    if arr is None:
        arr, keep = np.asarray(img), None
    return torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0), keep


def _rgbx_array(img: Image.Image) -> tuple[np.ndarray | None, object]:
    if not hasattr(img, "__arrow_c_array__"):
        return None, None
    width, height = img.size
    try:
        schema_capsule, array_capsule = img.__arrow_c_array__()
    except Exception:  # e.g. "image is in several memory blocks"
        return None, None
    schema = _ArrowSchema.from_address(_capsule_pointer(schema_capsule, b"arrow_schema"))
    array = _ArrowArray.from_address(_capsule_pointer(array_capsule, b"arrow_array"))
    if schema.format != b"+w:4" or schema.n_children != 1 or schema.children[0].contents.format != b"C":
        return None, None
    if array.length != width * height or array.offset != 0 or array.n_children != 1:
        return None, None
    child = array.children[0].contents
    if (
        child.length != 4 * width * height
        or child.offset != 0
        or child.n_buffers != 2
        or not child.buffers[1]
    ):
        return None, None
    data = (ctypes.c_uint8 * child.length).from_address(child.buffers[1])
    return np.frombuffer(data, dtype=np.uint8).reshape(height, width, 4), (schema_capsule, array_capsule, img)
