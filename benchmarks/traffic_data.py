"""A synthetic but realistic traffic record for the default det model (PP-OCRv4 det, input x: N x 3 x H x W, H and W
multiples of 32): document pages photographed by phones and scanned, resized as an OCR service does before detection
(the long side to 960, each side rounded to a multiple of 32), batches of 1..4, and a few rare odd requests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# (width, height) of what arrives: phone photos (4:3, 16:9, portrait and landscape), scans of A4 and Letter at 150-300
# dpi, screenshots
SOURCES = [((3024, 4032), 30), ((4032, 3024), 8), ((1080, 1920), 10), ((1920, 1080), 4), ((2480, 3508), 18),
           ((1654, 2339), 12), ((2550, 3300), 8), ((1275, 1650), 4), ((1242, 2688), 6)]
BATCHES = [(1, 70), (2, 18), (4, 12)]
LONG_SIDE = 960


def det_shape(w: int, h: int) -> tuple[int, int]:
    scale = LONG_SIDE / max(w, h)
    return max(32, int(round(h * scale / 32)) * 32), max(32, int(round(w * scale / 32)) * 32)


def document_traffic(path: Path, requests: int = 20_000, seed: int = 0) -> Path:
    """Writes ``path`` (JSON Lines, one line per distinct shape with its count) and returns it."""
    rng = np.random.default_rng(seed)
    src_w = np.array([w for _, w in SOURCES], float)
    b_w = np.array([w for _, w in BATCHES], float)
    counts: dict[tuple, int] = {}
    for _ in range(requests):
        (w, h), _ = SOURCES[rng.choice(len(SOURCES), p=src_w / src_w.sum())]
        if rng.random() < 0.15:  # cropped before upload: the aspect ratio moves a little
            w = int(w * rng.uniform(0.8, 1.0))
        hh, ww = det_shape(w, h)
        b = BATCHES[rng.choice(len(BATCHES), p=b_w / b_w.sum())][0]
        counts[(b, hh, ww)] = counts.get((b, hh, ww), 0) + 1
    # rare odd ones: a long receipt strip, a panorama, a batch of 16 thumbnails
    for shape, n in (((1, 3, 1920, 416), 3), ((1, 3, 416, 1920), 2), ((16, 3, 128, 128), 4)):
        counts[(shape[0], shape[2], shape[3])] = n
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for (b, hh, ww), n in sorted(counts.items()):
            f.write(json.dumps({"x": [b, 3, hh, ww], "count": n}) + "\n")
    return path
