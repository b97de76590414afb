"""The token stream a sweep trains on: bytes of the Python standard library's source (the
demo's corpus, uncapped), a user's text file (its bytes) or a token file (.npy / .pt of
integers).

Every run of a sweep draws its batches from :class:`TokenBatches` seeded with the run's seed and
nothing else, so seed s gives the same batches, in the same order, to every recipe; the held-out
batches are drawn once, from a fixed seed, and every run is evaluated on them.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp4gen.demo.data import ByteBatches, stdlib_corpus
from fp4gen.errors import FP4GenError

TOKEN_SUFFIXES = (".npy", ".pt", ".pth")
MAX_VOCAB = 1 << 20  # a token id past this is a wrong file, not a vocabulary (embedding memory)
MIN_WINDOWS = 20  # the data must hold this many context windows, so the 10% held out holds two
# The demo's files, all of them rather than its first 4 MB (about 25 MB on CPython 3.11): a
# sweep of 50M tokens then passes over its training split about twice, not a dozen times.
STDLIB_BYTES = 64 << 20
EVAL_SEED = 0x5EED  # the held-out batches: the same for every recipe and every seed


@dataclass(frozen=True)
class TokenData:
    tokens: torch.Tensor  # int64, 1-D
    vocab: int  # the largest id + 1 (256 for bytes)
    source: str  # what it is, for the log and summary.json
    fingerprint: str  # sha256 of the tokens: a resumed sweep must train on the same data

    @property
    def split(self) -> int:
        """Where the held-out last 10% starts (as the demo's ByteBatches splits)."""
        return int(len(self.tokens) * 0.9)


class TokenBatches(ByteBatches):
    """The demo's random-window batches over any integer token stream (not only bytes)."""

    def __init__(self, tokens: torch.Tensor, context: int, seed: int = 0) -> None:
        # ByteBatches' own constructor decodes bytes; the windows and the split are the same
        split = int(len(tokens) * 0.9)
        self.train, self.val = tokens[:split], tokens[split:]
        self.context = context
        self.generator = torch.Generator().manual_seed(seed)


def held_out_batches(
    data: TokenData, context: int, batches: int, size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out set: ``batches`` batches of ``size`` windows from the last 10%."""
    stream = TokenBatches(data.tokens, context, seed=EVAL_SEED)
    return [stream.batch(size, "val") for _ in range(batches)]


def _fingerprint(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()


def _from_bytes(raw: bytes, source: str) -> TokenData:
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    return TokenData(tokens, 256, source, _fingerprint(tokens))


@functools.lru_cache(maxsize=1)
def _stdlib_data() -> TokenData:
    # read once per process (a thousand files): nothing writes to the tensor, so sharing is safe
    raw = stdlib_corpus(max_bytes=STDLIB_BYTES)
    return _from_bytes(raw, f"Python standard library source, {len(raw):,} bytes")


def _load_token_file(path: Path) -> torch.Tensor:
    """The integers of a .npy or .pt file as a 1-D int64 tensor (N-D arrays are flattened)."""
    try:
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)  # no pickle: a data file runs no code
            if not isinstance(array, np.ndarray):
                raise FP4GenError(f"--data {path}: holds no array")
            if array.dtype.kind not in "iu":
                raise FP4GenError(
                    f"--data {path}: a token file holds integers, this one {array.dtype}"
                )
            if array.dtype.kind == "u" and array.size and int(array.max()) >= MAX_VOCAB:
                raise FP4GenError(
                    f"--data {path}: token id {int(array.max())} is past the limit {MAX_VOCAB - 1}"
                )
            tensor = torch.from_numpy(array.astype(np.int64).reshape(-1))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, torch.Tensor):
                raise FP4GenError(
                    f"--data {path}: a .pt token file holds one tensor, this one a "
                    f"{type(loaded).__name__}"
                )
            if loaded.is_floating_point() or loaded.is_complex() or loaded.dtype == torch.bool:
                raise FP4GenError(
                    f"--data {path}: a token file holds integers, this one {loaded.dtype}"
                )
            tensor = loaded.reshape(-1).to(torch.int64)
    except FP4GenError:
        raise
    except OSError:
        raise  # the CLI words file-system errors itself (path and reason)
    except Exception as err:  # a damaged or foreign file: any parser failure is the file's fault
        # not the loaders' own text: both advise unpickling the file, which would run its code
        loader = "numpy.load(allow_pickle=False)" if path.suffix == ".npy" else "torch.load"
        raise FP4GenError(
            f"--data {path}: not a readable {path.suffix} token file ({loader} raised "
            f"{type(err).__name__}); a token file holds one integer array or tensor"
        ) from None
    return tensor


def load_data(path: str | None, context: int) -> TokenData:
    """The sweep's tokens, checked: readable, integers in [0, 2^20), and long enough for
    ``MIN_WINDOWS`` windows of ``context`` + 1 tokens."""
    if path is None:
        data = _stdlib_data()
    else:
        file = Path(path)
        if "\0" in path:
            raise FP4GenError(f"--data {path!r}: a file name holds no NUL byte")
        if not file.exists():
            raise FP4GenError(f"--data {path}: no such file")
        if not file.is_file():
            raise FP4GenError(f"--data {path}: not a regular file")
        if file.suffix in TOKEN_SUFFIXES:
            tokens = _load_token_file(file)
            if tokens.numel() and int(tokens.min()) < 0:
                raise FP4GenError(
                    f"--data {path}: token ids are non-negative, found {tokens.min()}"
                )
            if tokens.numel() and int(tokens.max()) >= MAX_VOCAB:
                raise FP4GenError(
                    f"--data {path}: token id {int(tokens.max())} is past the limit {MAX_VOCAB - 1}"
                )
            vocab = int(tokens.max()) + 1 if tokens.numel() else 0
            data = TokenData(
                tokens, vocab, f"{file.name}, {len(tokens):,} tokens", _fingerprint(tokens)
            )
        else:
            data = _from_bytes(file.read_bytes(), f"{file.name}, {file.stat().st_size:,} bytes")
    need = MIN_WINDOWS * (context + 1)
    if len(data.tokens) < need:
        raise FP4GenError(
            f"--data: {data.source} is too short: the model's context of {context} needs at "
            f"least {need:,} tokens ({MIN_WINDOWS} windows, so the 10% held out holds two)"
        )
    return data
