"""Reading a data file line by line in bounded memory, whatever the file holds.

Every file-backed data source (``jsonl``, ``gsm8k``, ``humaneval``) reads its file here: one
line at a time, never the whole file, and no line longer than the source's ``max_row_mb``
(8 MiB unless raised). A longer line is read past in 1 MiB chunks, never held whole, and
reported at its ``file:line`` by the caller, so a 50 MB row, a JSON array written on one line
or a file with no newline at all costs at most the cap in memory. A ``.gz`` file is read
through gzip; a damaged gzip stream, or a read error, is a ``DataError`` at the line it
reached, not a traceback.

``sniff`` names a file that is not text at all from its first bytes: a compressed file or an
archive by its magic number, UTF-16 by its byte order mark, anything else holding a NUL byte as
"binary".
"""

from __future__ import annotations

import gzip
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Annotated, Iterator

from pydantic import Field

from gfcr.errors import DataError, Location, Problem

MIB = 1 << 20
DEFAULT_MAX_ROW_MB = 8
MaxRowMb = Annotated[int, Field(ge=1, le=4096, description=(
    "the longest row read, MiB; a longer line is a bad row, passed over without being held in memory"))]

# how a file that is not JSON lines starts: magic numbers and byte order marks
MAGIC = {b"\x1f\x8b": "gzip-compressed", b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed",
         b"\x28\xb5\x2f\xfd": "zstd-compressed", b"PK\x03\x04": "a zip archive", b"PAR1": "a Parquet file",
         b"\xff\xfe": "UTF-16 text", b"\xfe\xff": "UTF-16 text"}
DECOMPRESS = {"gzip-compressed": ("decompress or convert it to JSON lines (`gunzip -k FILE`), or give it a name ending "
                                   "in `.gz`: gfcr reads `.jsonl.gz` through gzip"),
              "UTF-16 text": "save it as UTF-8 (`iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8`)"}
BINARY_LINE_FIX = "remove the line, or write the file again: part of a binary or compressed file is in it"


def max_row_bytes(max_row_mb: int) -> int:
    return max_row_mb * MIB


def too_long(max_row_mb: int, file: str) -> tuple[str, str]:
    """The message and fix of a line of ``file`` over the cap."""
    return (f"the row is longer than {max_row_mb} MiB, the most a row may have (`max_row_mb: {max_row_mb}`)",
            f"if rows this long are meant, raise `max_row_mb:` in the source's `with:` (e.g. `max_row_mb: "
            f"{max_row_mb * 8}`); a JSON-lines file holds one object a line (a JSON array on one line converts "
            f"with `jq -c '.[]' {file} > rows.jsonl`)")


@contextmanager
def open_data(path: Path) -> Iterator[IO[bytes]]:
    """``path`` opened for reading bytes, through gzip when its name ends in ``.gz``."""
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
        yield handle


def numbered_lines(handle: IO[bytes], path: Path, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """``(line, bytes)`` for each line of ``handle``, from 1, its newline kept; ``None`` for a
    line over ``max_bytes``, which is read past without being held. A read error or a damaged
    gzip stream is a DataError at the line being read."""
    line = 0
    try:
        while True:
            line += 1
            raw = handle.readline(max_bytes + 1)
            if not raw:
                return
            if len(raw) > max_bytes and not raw.endswith(b"\n"):
                raw = None
                while (chunk := handle.readline(MIB)) and not chunk.endswith(b"\n"):
                    pass
            yield line, raw
    except (EOFError, zlib.error, OSError) as exc:
        raise read_error(path, line, exc) from None


@contextmanager
def read_errors(path: Path, line: int) -> Iterator[None]:
    """Turns a read error, or a damaged gzip stream, met at ``line`` into a DataError there."""
    try:
        yield
    except (EOFError, zlib.error, OSError) as exc:
        raise read_error(path, line, exc) from None


def read_error(path: Path, line: int, exc: BaseException) -> DataError:
    if isinstance(exc, (EOFError, zlib.error, gzip.BadGzipFile)):
        return DataError([Problem(Location(str(path), line), "",
                                  f"the gzip data of {path} is damaged or cut short ({exc or type(exc).__name__}); "
                                  f"the lines before {line} read", "re-create or re-download the file")])
    reason = getattr(exc, "strerror", None) or exc
    return DataError([Problem(Location(str(path), line), "", f"{path} cannot be read: {reason}",
                              "make it readable (check its permissions and the disk)")])


def sniff(head: bytes) -> str | None:
    """What the first bytes of a file say it is when it is not text: "gzip-compressed",
    "UTF-16 text", ..., "binary" (a NUL byte); None for text."""
    for magic, kind in MAGIC.items():
        if head.startswith(magic):
            return kind
    return "binary" if b"\0" in head else None


def binary_problem(path: Path, head: bytes, what: str, fix: str) -> Problem | None:
    """The problem of a data file whose first bytes ``head`` are not text, or None."""
    kind = sniff(head)
    if kind is None:
        return None
    nul = head.find(b"\0")
    line = head[:nul].count(b"\n") + 1 if nul >= 0 else 1
    if kind == "binary" and line > 1:  # text, then binary data pasted in
        return Problem(Location(str(path), line), "", f"{what}: {path} holds binary data on line {line} (a NUL "
                       "byte), not JSON text", f"{BINARY_LINE_FIX}; or {fix}")
    detail = f"a NUL byte on line {line}" if kind == "binary" else kind
    how = DECOMPRESS.get(kind, "decompress or convert it to JSON lines (one object per line)").replace("FILE", str(path))
    return Problem(Location(str(path), line), "", f"{what}: {path} is a binary file, not JSON lines ({detail})",
                   f"{how}; or {fix}")
