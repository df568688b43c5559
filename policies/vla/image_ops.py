"""The image operations of OpenVLA's and OpenVLA-OFT's LIBERO eval scripts, without TensorFlow.

Upstream (``experiments/robot/openvla_utils.py``, ``libero/libero_utils.py``) prepares each frame
as its RLDS training data was prepared: a JPEG round trip, a lanczos3 antialiased resize
(``tf.image.resize``), and for models trained with random-crop augmentation a centre crop of
90% of the area resized back (``tf.image.crop_and_resize``, bilinear). These functions redo that
arithmetic in float32 numpy in TensorFlow's order, so the project needs no TensorFlow; the
reference fixtures (assets/reference) hold TensorFlow's own results for them to match.

Shapes: uint8 images ``[H, W, 3]``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import io

import numpy as np
from PIL import Image

JPEG_QUALITY = 95  # tf.image.encode_jpeg's default (4:2:0 chroma, baseline), as PIL writes it too
LANCZOS_RADIUS = 3
PI = np.float32(3.14159265359)  # TensorFlow's constant in its lanczos kernel


def jpeg_round_trip(image: np.ndarray) -> np.ndarray:
    """Encode as JPEG (quality 95) and decode again, as the RLDS dataset builder stored frames.

    PIL writes the same entropy-coded data as ``tf.image.encode_jpeg``; ``tf.io.decode_image``
    decodes with libjpeg's *fast integer* DCT and fancy upsampling, which PIL cannot (its
    accurate DCT differs by up to 13 levels), so simplejpeg (libjpeg-turbo) decodes."""
    import simplejpeg

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image)).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return simplejpeg.decode_jpeg(buffer.getvalue(), colorspace="RGB", fastdct=True, fastupsample=False)


@functools.cache
def _libm_sinf():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.sinf.restype, libm.sinf.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.sinf


def _sinf(x: np.ndarray) -> np.ndarray:
    """C's ``sinf``, which TensorFlow's kernel calls: numpy's float32 sine, and float64 sine
    rounded to float32, each differ from it by an ulp on some arguments (and so do the weights)."""
    sinf = _libm_sinf()
    return np.array([sinf(float(v)) for v in x.ravel()], dtype=np.float32).reshape(x.shape)


def _lanczos3(x: np.ndarray) -> np.ndarray:
    x = np.abs(x).astype(np.float32)
    radius = np.float32(LANCZOS_RADIUS)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = radius * _sinf(PI * x) * _sinf(PI * x / radius) / (PI * PI * x * x)
    value = np.where(x <= np.float32(1e-3), np.float32(1.0), value)
    return np.where(x > radius, np.float32(0.0), value).astype(np.float32)


@functools.cache
def _spans(output_size: int, input_size: int) -> tuple[np.ndarray, np.ndarray]:
    """TensorFlow's ``ComputeSpans`` for an antialiased lanczos3 resize: per output pixel the first
    input pixel and the normalised weights ``[output_size, span]`` (zero past a pixel's span)."""
    scale = np.float32(output_size) / np.float32(input_size)
    inv_scale = np.float32(1.0) / scale
    kernel_scale = max(inv_scale, np.float32(1.0))
    reach = np.float32(LANCZOS_RADIUS) * kernel_scale
    span_size = min(2 * int(np.ceil(reach)) + 1, input_size)
    starts = np.zeros(output_size, dtype=np.int64)
    weights = np.zeros((output_size, span_size), dtype=np.float32)
    for x in range(output_size):
        sample = (np.float32(x) + np.float32(0.5)) * inv_scale
        start = min(max(int(np.ceil(sample - reach - np.float32(0.5))), 0), input_size - 1)
        end = min(max(int(np.floor(sample + reach - np.float32(0.5))), 0), input_size - 1) + 1
        inverse_scale = np.float32(1.0) / kernel_scale
        positions = (np.arange(start, end, dtype=np.float32) + np.float32(0.5) - sample) * inverse_scale
        w = _lanczos3(positions)
        total = np.float32(0.0)
        for value in w:  # sequential float32 sum, as the C++ loop adds them
            total = np.float32(total + value)
        if abs(total) >= 1000 * np.finfo(np.float32).tiny:
            w = (w * (np.float32(1.0) / total)).astype(np.float32)
        starts[x], weights[x, :len(w)] = start, w
    return starts, weights


def _gather(image: np.ndarray, starts: np.ndarray, weights: np.ndarray, axis: int) -> np.ndarray:
    """Resample float32 ``image`` along ``axis`` (0 rows, 1 columns), accumulating span by span."""
    moved = np.moveaxis(image, axis, 0)
    out = np.zeros((len(starts), *moved.shape[1:]), dtype=np.float32)
    for k in range(weights.shape[1]):
        index = np.minimum(starts + k, moved.shape[0] - 1)
        w = weights[:, k].reshape(-1, *([1] * (moved.ndim - 1)))
        out = (out + moved[index] * w).astype(np.float32)
    return np.moveaxis(out, 0, axis)


def lanczos_resize(image: np.ndarray, size: int) -> np.ndarray:
    """``tf.image.resize(image, (size, size), "lanczos3", antialias=True)``, rounded and clipped to uint8
    (rows first, then columns, as TensorFlow's ScaleAndTranslate gathers)."""
    pixels = image.astype(np.float32)
    rows = _gather(pixels, *_spans(size, image.shape[0]), axis=0)
    out = _gather(rows, *_spans(size, image.shape[1]), axis=1)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def dataset_resize(image: np.ndarray, size: int) -> np.ndarray:
    """What upstream's ``resize_image`` / ``resize_image_for_policy`` does: JPEG, then lanczos3."""
    return lanczos_resize(jpeg_round_trip(image), size)


def center_crop(image: np.ndarray, area: float = 0.9) -> np.ndarray:
    """Upstream's centre crop: the central ``area`` of the frame (side ``sqrt(area)``), resized back
    to the frame's size with ``tf.image.crop_and_resize`` (bilinear) on ``uint8 / 255`` floats, then
    ``convert_image_dtype`` back to uint8 (``trunc(x * 255.5)``)."""
    height, width = image.shape[:2]
    side = np.sqrt(np.float32(area)).astype(np.float32)
    offset = ((np.float32(1.0) - side) / np.float32(2.0)).astype(np.float32)
    pixels = image.astype(np.float32) * np.float32(1.0 / 255)
    ys = _crop_coordinates(offset, offset + side, height, height)
    xs = _crop_coordinates(offset, offset + side, width, width)
    out = _bilinear(pixels, ys, xs)
    return (np.clip(out, 0.0, 1.0) * np.float32(255.5)).astype(np.uint8)


def _crop_coordinates(low: np.float32, high: np.float32, crop: int, size: int) -> np.ndarray:
    scale = ((high - low) * np.float32(size - 1) / np.float32(crop - 1)).astype(np.float32)
    return (low * np.float32(size - 1) + np.arange(crop, dtype=np.float32) * scale).astype(np.float32)


def _bilinear(pixels: np.ndarray, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """crop_and_resize's interpolation: along x within the top and bottom rows, then along y."""
    top, left = np.floor(ys).astype(np.int64), np.floor(xs).astype(np.int64)
    bottom, right = np.ceil(ys).astype(np.int64), np.ceil(xs).astype(np.int64)
    y_lerp = (ys - top.astype(np.float32)).astype(np.float32)[:, None, None]
    x_lerp = (xs - left.astype(np.float32)).astype(np.float32)[None, :, None]
    tl, tr = pixels[top][:, left], pixels[top][:, right]
    bl, br = pixels[bottom][:, left], pixels[bottom][:, right]
    upper = (tl + (tr - tl) * x_lerp).astype(np.float32)
    lower = (bl + (br - bl) * x_lerp).astype(np.float32)
    return (upper + (lower - upper) * y_lerp).astype(np.float32)
