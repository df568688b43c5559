"""Observations -> VLA inputs: images resized and normalised per vision backbone, prompts tokenized.

Images follow the checkpoint's own ``preprocessor_config.json`` (OpenVLA's
``PrismaticImageProcessor``, whose saved ``tvf_*`` fields are what it applies): with the
``letterbox`` strategy, first a symmetric pad to a square (``tvf_letterbox_fill``); then per
backbone a PIL resize (to ``(H, W)`` for ``resize-naive``, the shorter side to ``S`` for
``letterbox`` and ``resize-crop``; bicubic for every public OpenVLA checkpoint), a centre crop,
``/ 255`` and the normalisation saved there, which for
openvla-7b and its fine-tunes is DINOv2's ImageNet statistics **rounded to bf16** (the HF
conversion ran under a bf16 default dtype) and SigLIP's 0.5 / 0.5. The results are stacked on
channels, as upstream's processor stacks them.

Shapes: ``rgb`` uint8 ``[B, H, W, 3]`` -> ``pixel_values`` float ``[B, 3 * backbones, S, S]``;
instructions -> ``input_ids [B, L]`` and ``attention_mask [B, L]``: BOS, left padding, the prompt,
so every row's BOS is column 0 and its last prompt token the last column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from envs.common import UserError
from policies.vla.checkpoint import PREPROCESSOR_FILE, read_json

# timm's data configs of OpenVLA's two backbones (DINOv2: ImageNet; SigLIP: [0, 1] -> [-1, 1])
DEFAULT_MEANS = ((0.485, 0.456, 0.406), (0.5, 0.5, 0.5))
DEFAULT_STDS = ((0.229, 0.224, 0.225), (0.5, 0.5, 0.5))
PIL_FILTERS = {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1}


RESIZE_STRATEGIES = ("resize-naive", "letterbox", "resize-crop")  # Prismatic's image_resize_strategy values


@dataclass(frozen=True)
class BackboneTransform:
    """One backbone's view of an image: resize to ``size`` ((H, W), or an int: the shorter side,
    the longer one scaled to keep the aspect, as ``torchvision``'s ``resize`` computes it) with PIL
    filter ``resample``, centre crop to ``crop`` (H, W), then ``(x / 255 - mean) / std`` per channel."""

    size: tuple[int, int] | int
    resample: int
    crop: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """``(H, W)`` after the resize (torchvision's ``_compute_resized_output_size``)."""
        if not isinstance(self.size, int):
            return self.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size, int(self.size * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def resized(self, image: Image.Image) -> Image.Image:
        height, width = self.output_size(image.height, image.width)
        if image.size != (width, height):
            image = image.resize((width, height), self.resample)
        return center_crop(image, self.crop)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[3, H, W]`` in [0, 1] -> normalised (torchvision's ``normalize`` arithmetic)."""
        mean = torch.tensor(self.mean, dtype=x.dtype).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype).view(3, 1, 1)
        return (x - mean) / std


def center_crop(image: Image.Image, crop: tuple[int, int]) -> Image.Image:
    """torchvision's ``center_crop`` of a PIL image to ``crop`` (H, W): zero padding first where the
    image is smaller, then the crop whose top-left corner is ``round((size - crop) / 2)``."""
    width, height = image.size
    if crop[0] > height or crop[1] > width:
        pad_w, pad_h = max(crop[1] - width, 0), max(crop[0] - height, 0)
        image = ImageOps.expand(image, (pad_w // 2, pad_h // 2, (pad_w + 1) // 2, (pad_h + 1) // 2), fill=0)
        width, height = image.size
    if (height, width) == crop:
        return image
    top, left = int(round((height - crop[0]) / 2.0)), int(round((width - crop[1]) / 2.0))
    return image.crop((left, top, left + crop[1], top + crop[0]))


def letterbox(image: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """Prismatic's ``letterbox_pad_transform``: pad to square with ``fill``, ``int((max - side) / 2)``
    on each side (so an odd difference leaves the image one pixel short of square, as upstream's does)."""
    width, height = image.size
    side = max(width, height)
    horizontal, vertical = int((side - width) / 2), int((side - height) / 2)
    return ImageOps.expand(image, (horizontal, vertical, horizontal, vertical), fill=tuple(fill))


@dataclass(frozen=True)
class ImageProcessing:
    """A Prismatic image processor: an optional letterbox pad, then one :class:`BackboneTransform`
    per vision backbone."""

    transforms: tuple[BackboneTransform, ...]
    strategy: str = "resize-naive"  # image_resize_strategy, as the file names it (for the run log)
    letterbox_fill: tuple[int, int, int] | None = None  # pad to square with this colour first

    @classmethod
    def default(cls, size: int, backbones: int = 2) -> ImageProcessing:
        """What ``PrismaticImageProcessor`` computes for a fused DINOv2 + SigLIP model (bicubic,
        unrounded statistics): for models built here without a preprocessor file."""
        return cls(tuple(BackboneTransform((size, size), PIL_FILTERS["bicubic"], (size, size), DEFAULT_MEANS[i],
                                           DEFAULT_STDS[i]) for i in range(backbones)))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, sizes: list[int], backbones: int = 2) -> ImageProcessing:
        """The ``tvf_*`` parameters of ``model_dir``'s preprocessor_config.json (what upstream's
        processor applies); the default when the directory has none. ``sizes``: each backbone's
        input size (config.json ``image_sizes``), which its crop must give."""
        path = Path(model_dir) / PREPROCESSOR_FILE
        if not path.exists():
            return cls.default(sizes[0], backbones)
        saved = read_json(path)
        strategy = saved.get("image_resize_strategy", "resize-naive")
        if strategy not in RESIZE_STRATEGIES:
            raise UserError(f"{path}: image_resize_strategy={strategy!r} is not one of Prismatic's "
                            f"{list(RESIZE_STRATEGIES)} (upstream's processor raises on it too). Copy the file "
                            "from the checkpoint it belongs to.")
        resizes = [r for r in saved.get("tvf_resize_params") or [] if isinstance(r, dict)]
        capped = [r["max_size"] for r in resizes if r.get("max_size") is not None]
        if capped:  # upstream's processor always saves null (timm's transforms have no cap)
            raise UserError(f"{path}: tvf_resize_params max_size={capped[0]} is not supported (only null, which "
                            "OpenVLA's processor always saves). Copy the file from the checkpoint it belongs to.")
        try:
            transforms = tuple(_transform_from_saved(r, c, n) for r, c, n in zip(
                saved["tvf_resize_params"], saved["tvf_crop_params"], saved["tvf_normalize_params"], strict=True))
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"{path} is not a PrismaticImageProcessor config ({err!r}): it needs tvf_resize_params, "
                            "tvf_crop_params and tvf_normalize_params per backbone, as OpenVLA's "
                            "processing_prismatic.py saves them. Copy the file from the checkpoint you "
                            "fine-tuned.") from err
        if len(transforms) != backbones:
            raise UserError(f"{path} has {len(transforms)} backbone transforms; the model has {backbones} vision "
                            "backbones (config.json use_fused_vision_backbone). The file belongs to another "
                            "checkpoint: copy the one saved with config.json.")
        for t, size in zip(transforms, sizes, strict=False):
            if t.crop != (size, size):
                raise UserError(f"{path}: tvf_crop_params gives {t.crop[0]} x {t.crop[1]} images, but config.json "
                                f"image_sizes says the vision backbone takes {size} x {size}. The two files belong "
                                "to different checkpoints: copy both from one.")
        return cls(transforms, strategy, _letterbox_fill(saved, path))

    def describe(self) -> str:
        """For the run log: ``letterbox (fill 127,127,127), bicubic to 224 px`` or the like."""
        inverse = {v: k for k, v in PIL_FILTERS.items()}
        fill = f" (fill {','.join(map(str, self.letterbox_fill))})" if self.letterbox_fill else ""
        sizes = sorted({t.crop[0] for t in self.transforms})
        return (f"{self.strategy}{fill}, {inverse.get(self.transforms[0].resample, self.transforms[0].resample)} "
                f"to {'/'.join(map(str, sizes))} px")

    def save_pretrained(self, model_dir: str | Path) -> None:
        """Write the ``tvf_*`` fields upstream's processor reads and writes."""
        inverse = {v: k for k, v in PIL_FILTERS.items()}
        fields = {
            "image_processor_type": "PrismaticImageProcessor", "processor_class": "PrismaticProcessor",
            "image_resize_strategy": self.strategy, "use_fused_vision_backbone": len(self.transforms) > 1,
            "input_sizes": [[3, *t.crop] for t in self.transforms],
            "interpolations": [inverse[t.resample] for t in self.transforms],
            "means": [list(t.mean) for t in self.transforms], "stds": [list(t.std) for t in self.transforms],
            "tvf_resize_params": [{"size": t.size if isinstance(t.size, int) else list(t.size),
                                   "interpolation": t.resample, "max_size": None, "antialias": True}
                                  for t in self.transforms],
            "tvf_crop_params": [{"output_size": list(t.crop)} for t in self.transforms],
            "tvf_normalize_params": [{"mean": list(t.mean), "std": list(t.std), "inplace": False}
                                     for t in self.transforms],
            "tvf_do_letterbox": self.letterbox_fill is not None,
            "tvf_letterbox_fill": list(self.letterbox_fill) if self.letterbox_fill else None,
        }
        (Path(model_dir) / PREPROCESSOR_FILE).write_text(json.dumps(fields, indent=2))

    def __call__(self, rgb: torch.Tensor) -> torch.Tensor:
        """``rgb`` uint8 ``[B, H, W, 3]`` -> ``[B, 3 * backbones, S, S]`` float32."""
        frames = rgb.detach().to("cpu", torch.uint8).numpy()
        rows = [self._one(Image.fromarray(frame)) for frame in frames]
        return torch.stack(rows).to(rgb.device)

    def _one(self, image: Image.Image) -> torch.Tensor:
        if self.letterbox_fill is not None:
            image = letterbox(image, self.letterbox_fill)
        views, cache = [], {}
        for t in self.transforms:
            key = (t.size, t.resample, t.crop)
            if key not in cache:  # both backbones usually resize alike: do it once
                pixels = np.asarray(t.resized(image), dtype=np.uint8)
                cache[key] = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div(255)
            views.append(t.normalize(cache[key]))
        return torch.cat(views, dim=0)


def _letterbox_fill(saved: dict, path: Path) -> tuple[int, int, int] | None:
    """The pad colour when the processor letterboxes (its saved ``tvf_do_letterbox``), else None."""
    if not saved.get("tvf_do_letterbox"):
        return None
    fill = saved.get("tvf_letterbox_fill")
    if not (isinstance(fill, list) and len(fill) == 3 and all(isinstance(v, int) for v in fill)):
        raise UserError(f"{path}: tvf_do_letterbox is true but tvf_letterbox_fill={fill!r} is not three integers "
                        "(upstream saves a backbone's normalisation mean * 255, e.g. [127, 127, 127]). Copy the file "
                        "from the checkpoint it belongs to.")
    return tuple(fill)


def _transform_from_saved(resize: dict, crop: dict, normalize: dict) -> BackboneTransform:
    """One backbone's ``tvf_*`` entries; a one-element size list is torchvision's shorter-side int."""
    size = resize["size"]
    if isinstance(size, list) and len(size) == 1:
        size = size[0]
    size = size if isinstance(size, int) else tuple(size)
    crop_size = crop["output_size"]
    crop_size = (crop_size, crop_size) if isinstance(crop_size, int) else tuple(crop_size)
    return BackboneTransform(size, int(resize["interpolation"]), crop_size, tuple(normalize["mean"]),
                             tuple(normalize["std"]))


def tokenize_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, L]``: each row ``[BOS] + padding + prompt``, so every
    row's BOS is column 0 (OpenVLA puts the image patches right after it, as RLinf's batches do)
    and its last prompt token the last column. No BOS column where the tokenizer has none (Qwen)."""
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row):] = torch.tensor(row)
        mask[i, length - len(row):] = 1
    if tokenizer.bos_token_id is None:
        return ids, mask
    return (torch.cat([torch.full_like(ids[:, :1], tokenizer.bos_token_id), ids], dim=1),
            torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1))


def byte_tokenizer(reserved: int = 256) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer for tiny VLAs: 256 byte tokens, BOS / EOS / PAD, then ``reserved``
    unused tokens at the end of the vocabulary, which OpenVLA-style models use as action tokens
    (they are never produced by text). Deterministic: nothing is trained or downloaded."""
    byte_vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.add_tokens([f"<unused_{i}>" for i in range(reserved)], special_tokens=True)
    return fast
