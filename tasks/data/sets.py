"""The data sets of a build (calibration, search, validation: ``DataSet``, made lazily), the split of one build into
them (``DataSplit``, made by tasks/data/datasets.py) and the arrays the user gave (``UserData``)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tasks.data.inputs import DataRecord, batch_size

Feed = dict[str, np.ndarray]
MIN_EVIDENCE = 5  # a validation on fewer samples says its evidence is thin


@dataclass
class DataSet:
    purpose: str  # calibration | search | validation
    kind: str  # file | images | synthetic | random
    source: str  # in words, for summary.json and the report
    key: dict  # what the content depends on (part of the stages' cache keys)
    make: Callable[[], list[Feed]] | None = None
    notes: list[str] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)  # the user's files (and their sha256) or image files this set read
    _feeds: list[Feed] | None = None
    _known: dict | None = None  # record() of this content, kept by a stage that made it (see remember)

    @property
    def feeds(self) -> list[Feed]:
        if self._feeds is None:
            self._feeds = self.make() if self.make else []
        return self._feeds

    @property
    def made(self) -> bool:
        return self._feeds is not None

    @property
    def samples(self) -> int:
        return self._known["samples"] if self._feeds is None and self._known else sum(batch_size(f) for f in self.feeds)

    @property
    def distinct(self) -> int:
        """Samples whose content differs (hashed): the evidence a verdict on this set rests on."""
        if self._feeds is None and self._known:
            return self._known.get("distinct", self._known["samples"])
        return distinct_samples(self.feeds)

    def fingerprint(self) -> str:
        """What the content depends on, hashed (the key names it whole: seeds, shapes, generator, files' sha256)."""
        return hashlib.sha256(json.dumps([self.purpose, self.key], sort_keys=True, default=str).encode()).hexdigest()

    def remember(self, known: dict) -> None:
        """A record of this set kept by a cached stage ({"fingerprint", "record"}): summary.json's figures without
        making the data again (rendering a model's images takes seconds), taken only when the content is the same."""
        if self._feeds is None and known.get("fingerprint") == self.fingerprint():
            self._known = known["record"]

    @property
    def thin(self) -> list[str]:
        """Why this set is weak evidence for a verdict (empty when it is not)."""
        why = []
        if self.kind == "random":
            why.append("random inputs inside the profiles: the verdict says nothing about real inputs "
                       "(give validation.data, calibration.data or model.images)")
        n = self.distinct
        if n < MIN_EVIDENCE:
            why.append(f"only {n} distinct samples" + (f" (of {self.samples})" if n < self.samples else ""))
        return why

    def record(self) -> dict:
        if self._feeds is None and self._known is not None:
            return self._known
        rec = DataRecord.of(self.feeds, self.kind, files=self.files, notes=list(self.notes))
        return {"samples": rec.samples, "distinct": distinct_samples(self.feeds), "feeds": rec.feeds,
                "source": self.source, "kind": self.kind,
                "shapes": rec.shapes, **({"files": self.files} if self.files else {}),
                **({"notes": self.notes} if self.notes else {})}


@dataclass
class DataSplit:
    calibration: DataSet | None = None
    search: DataSet | None = None
    validation: DataSet | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """summary.json ``data``: one entry per set a stage read (or a cached stage's record of it) and per part of the
        user's own arrays, read or not (the split of their samples). A set generated for a stage that did not need it
        is not made only to be described (the fp16 search's held-out pages when the converted graph met the budget:
        22 rendered pages of PP-OCRv4 det, 1.75 s of the build)."""
        return {s.purpose: s.record() for s in self.sets() if s.made or s._known is not None or s.kind == "file"}

    def sets(self) -> list[DataSet]:
        return [s for s in (self.calibration, self.search, self.validation) if s is not None]

    def made_records(self) -> dict:
        """{purpose: {"fingerprint", "record"}} of the sets made so far: what a stage keeps with its result."""
        return {s.purpose: {"fingerprint": s.fingerprint(), "record": s.record()} for s in self.sets() if s.made}

    def remember(self, records: dict) -> None:
        for s in self.sets():
            if s.purpose in records:
                s.remember(records[s.purpose])


@dataclass
class UserData:
    """Arrays the user gave (calibration.data or validation.data), loaded and checked by tasks.data.inputs.load_data."""
    key: str  # the config key
    path: str
    sha256: str
    feeds: list[Feed]
    files: list[dict]



def sample_digests(feed: Feed) -> list[str]:
    """One hash per sample of a feed (its slices along axis 0 where every input shares it, else the whole feed)."""
    b = batch_size(feed)
    shared = b > 1 or all(a.ndim > 0 and a.shape[0] == 1 for a in feed.values())
    out = []
    for i in range(b):
        h = hashlib.sha256()
        for k in sorted(feed):
            a = np.ascontiguousarray(feed[k][i] if shared and feed[k].ndim > 0 else feed[k])
            h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        out.append(h.hexdigest())
    return out


def distinct_samples(feeds: list[Feed]) -> int:
    """How many samples of ``feeds`` differ in content (a repeated sample is no new evidence)."""
    return len({d for f in feeds for d in sample_digests(f)})


def describe_thin(s: DataSet | None) -> str | None:
    """One sentence for a verdict whose evidence is thin, or None."""
    if s is None or not s.thin:
        return None
    return f"thin evidence: {'; '.join(s.thin)}"


def as_user_data(key: str, loaded: tuple[list[Feed], DataRecord]) -> UserData:
    feeds, rec = loaded
    return UserData(key, rec.path or "", rec.sha256 or "", feeds, rec.files)

