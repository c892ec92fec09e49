"""validation.labels: one label per sample of validation.data, read and checked, then split per feed for a user
function."""
from __future__ import annotations

import numpy as np

from tasks.common.errors import ConfigError
from tasks.accuracy.metric import Feed, samples_in


def load_labels(path: str, samples: int) -> np.ndarray:
    """validation.labels: one label per sample of validation.data (axis 0), checked against its sample count."""
    try:
        got = np.load(path, allow_pickle=False)
        if isinstance(got, np.lib.npyio.NpzFile):
            with got as z:
                if len(z.files) != 1:
                    raise ValueError(f"it holds {len(z.files)} arrays {z.files[:4]}, not one")
                got = z[z.files[0]]
    except (OSError, ValueError) as e:
        raise ConfigError(f"validation.labels={path!r} cannot be read: {e}", file=str(path),
                          fix="save one array of labels, one per sample of validation.data: numpy.save(path, labels)"
                          ) from None
    if got.ndim == 0 or len(got) != samples:
        raise ConfigError(f"validation.labels={path!r} holds {0 if got.ndim == 0 else len(got)} labels but "
                          f"validation.data holds {samples} samples", file=str(path),
                          fix="give one label per sample of validation.data, in its order (axis 0)")
    return got


def labels_per_feed(labels: np.ndarray, feeds: list[Feed]) -> list[np.ndarray]:
    """The labels of each feed's samples: validation.data's feeds are its samples in order, batch after batch."""
    out, at = [], 0
    for f in feeds:
        n = samples_in(f)
        out.append(labels[at:at + n])
        at += n
    return out
