"""Split GGUF files (llama.cpp's gguf-split: `NAME-00001-of-00003.gguf`, ...) read as one.

The first part holds the metadata; every part holds `split.no` (0-based), `split.count` and
`split.tensors.count` (the tensors of all parts) and its share of the tensors. Invariants:
any part's path names the whole file; every part must exist, say its own place in the split,
agree on the counts, and together hold exactly `split.tensors.count` distinct tensors, or the
load fails with a ModelLoadError naming the part (a missing part, a part of another file, a
truncated part). Each part is memory-mapped by its own reader (gguf_reader), so packed tensors stay
views of the files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tessellm.errors import ModelLoadError

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_parts(path: Path) -> list[Path] | None:
    """The paths of every part of the split file `path` names (in order), or None when the
    name is not a part's (or a split into one part: a plain file)."""
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) < 2:
        return None
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


@dataclass
class SplitGGUF:
    """The readers of a split file's parts as one reader: the first part's `fields`, every
    part's `tensors` in order."""

    parts: list[Path]
    readers: list[Any]

    @property
    def fields(self) -> Any:
        return self.readers[0].fields

    @property
    def tensors(self) -> list[Any]:
        return [t for r in self.readers for t in r.tensors]


def _int_field(reader: Any, key: str, part: Path) -> int:
    f = reader.fields.get(key)
    value = None if f is None else f.contents()
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"GGUF part {part} lacks the split metadata {key} (is it a part "
                             "written by gguf-split?)")
    return value


def open_split(parts: list[Path], open_one: Callable[[Path], Any]) -> SplitGGUF:
    """Open and check every part (`open_one` opens a single GGUF file)."""
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"split GGUF file {parts[0].name}: {len(missing)} of its "
                             f"{len(parts)} parts are missing: {', '.join(missing)}")
    readers = [open_one(p) for p in parts]
    total = _int_field(readers[0], "split.tensors.count", parts[0])
    names: dict[str, Path] = {}
    for i, (part, reader) in enumerate(zip(parts, readers)):
        no, count = _int_field(reader, "split.no", part), _int_field(reader, "split.count", part)
        if (no, count) != (i, len(parts)):
            raise ModelLoadError(f"GGUF part {part} says it is part {no + 1} of {count}; its "
                                 f"name makes it part {i + 1} of {len(parts)} (a part of "
                                 "another file?)")
        if _int_field(reader, "split.tensors.count", part) != total:
            raise ModelLoadError(f"GGUF part {part} belongs to a split of "
                                 f"{_int_field(reader, 'split.tensors.count', part)} tensors, "
                                 f"{parts[0].name} to one of {total}: a part of another file")
        for t in reader.tensors:
            if t.name in names:
                raise ModelLoadError(f"GGUF parts {names[t.name]} and {part} both hold tensor "
                                     f"{t.name!r}: a part of another file")
            names[t.name] = part
    if len(names) != total:
        raise ModelLoadError(f"split GGUF file {parts[0].name}: its parts hold {len(names)} "
                             f"tensors, its metadata says {total} (a part of another file?)")
    return SplitGGUF(parts, readers)
