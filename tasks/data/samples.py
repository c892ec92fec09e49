"""Real-looking image inputs: text pages rendered with PIL, or a folder of images, preprocessed PP-OCR style."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tasks.common.errors import ConfigError

WORDS = ("TensorRT engine build calibrate validate benchmark export partition model target precision profile "
         "invoice total amount date 2026 receipt page number order shipping address quantity price tax "
         "the quick brown fox jumps over lazy dog 0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ").split()
GENERATOR_VERSION = 3  # part of cache keys: bump when generated sets change (3: a folder's images once per set)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"}


def _font(size: int):
    from PIL import ImageFont

    for path in ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "DejaVuSans.ttf"):
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            continue
    return ImageFont.load_default(size=size)


def render_text_image(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A page (or, for short heights, a single line) of dark text on a light background; HxWx3 uint8 RGB."""
    from PIL import Image, ImageDraw

    bg = int(rng.integers(215, 256))
    img = Image.new("RGB", (width, height), (bg, bg, bg))
    draw = ImageDraw.Draw(img)
    if height <= 96:  # a text line crop, as recognition/classification models see
        size = max(8, int(height * rng.uniform(0.55, 0.75)))
        rows = [int((height - size) / 2)]
    else:
        # font size in pixels independent of the page size (like scans at a given resolution), so every input
        # shape sees the same distribution of text scales
        size = int(rng.integers(12, max(13, min(48, height // 3)) + 1))
        rows = list(range(int(rng.integers(2, size + 3)), height - size, int(size * rng.uniform(1.5, 2.2))))
    font = _font(size)
    for y in rows:
        x = int(rng.integers(0, max(1, width // 12)))
        while x < width - size:
            word = WORDS[int(rng.integers(len(WORDS)))]
            ink = int(rng.integers(0, 70))
            draw.text((x, y), word, fill=(ink, ink, ink), font=font)
            x += int(draw.textlength(word + " ", font=font))
            if height > 96 and rng.random() < 0.08:
                break
    return np.asarray(img)


def load_image(path: Path, height: int, width: int) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB").resize((width, height)))


def list_images(folder: str, key: str) -> list[Path]:
    p = Path(folder).expanduser()
    if not p.is_dir():
        raise ConfigError(f"{key}={folder!r} is not a folder of images", fix="give a folder with .png/.jpg files, or synthetic:text")
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"{key}={folder!r} has no images ({', '.join(sorted(IMAGE_SUFFIXES))})", fix="add images to the folder")
    return files


LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2, as PIL's convert("L")


def preprocess(images: list[np.ndarray], recipe: Any) -> np.ndarray:
    """RGB uint8 HxWx3 images -> a float32 batch, following the recipe (channel order, scale, mean, std, layout);
    GRAY: one channel of luma, its mean and std the recipe's first (preflight checks they are one value)."""
    x = np.stack(images).astype(np.float32)
    order = str(recipe["channel_order"]).upper()
    mean, std = np.asarray(recipe["mean"], np.float32), np.asarray(recipe["std"], np.float32)
    if order == "BGR":
        x = x[..., ::-1]
    elif order == "GRAY":
        x = (x @ np.asarray(LUMA, np.float32))[..., None]
        mean, std = mean[:1], std[:1]
    x = x * float(recipe["scale"])
    x = (x - mean) / std
    if str(recipe["layout"]).upper() == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x, dtype=np.float32)


def images_batch(recipe: Any, shape: list[int], rng: np.random.Generator, start: int = 0,
                 files: list | None = None) -> np.ndarray:
    """A batch for one input of the given shape (N,C,H,W or N,H,W,C), images drawn from the recipe's source (a
    folder: its images in turn from ``start``, of ``files`` when given)."""
    nchw = str(recipe["layout"]).upper() == "NCHW"
    n, h, w = (shape[0], shape[2], shape[3]) if nchw else (shape[0], shape[1], shape[2])
    src = str(recipe["source"])
    if src.startswith("synthetic:"):
        if src != "synthetic:text":
            raise ConfigError(f"model.images.source={src!r} is unknown", fix="use synthetic:text or a folder of images")
        imgs = [render_text_image(h, w, rng) for _ in range(n)]
    else:
        files = files or list_images(src, "model.images.source")
        imgs = [load_image(files[(start + i) % len(files)], h, w) for i in range(n)]
    return preprocess(imgs, recipe)
