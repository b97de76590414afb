"""A byte corpus every machine has: the Python standard library's own source files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_corpus(max_bytes: int = 4 << 20) -> bytes:
    """The first ``max_bytes`` of the stdlib's .py files, in sorted path order (reproducible)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return b"".join(chunks)[:max_bytes]


class ByteBatches:
    """Random windows of a byte corpus: 90% for training, the last 10% held out."""

    def __init__(self, corpus: bytes, context: int, seed: int = 0) -> None:
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        split = int(len(data) * 0.9)
        self.train, self.val = data[:split], data[split:]
        self.context = context
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.context - 1, (size,), generator=self.generator)
        windows = torch.stack([data[s : s + self.context + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
