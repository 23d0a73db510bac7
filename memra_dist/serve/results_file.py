"""The batch job's output file: one complete JSON line per request, appended with a write,
a flush and an fsync while SIGINT / SIGTERM wait, cut back if the write fails; one job at a
time holds it (flock); a last line without its newline (a crash mid-write) is cut off on
open; the ids already there are what a resumed job skips (and the prompt hashes their records
hold, what it checks its input against)."""

from __future__ import annotations

import json
import os
import threading

from ..errors import UserError
from .workers import signals_held

__all__ = ["Output", "record_key", "id_key", "line_key", "is_int", "valid_id"]

def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def valid_id(v) -> bool:
    return isinstance(v, str) or is_int(v)


def id_key(v) -> str:
    return "id " + json.dumps(v)  # the id 7 and the id "7" are two ids


def line_key(n: int) -> str:
    return f"line {n}"


def record_key(rec) -> str | None:
    """The id or line an output record stands for (None: not a record of ours)."""
    if not isinstance(rec, dict):
        return None
    if "id" in rec and valid_id(rec["id"]):
        return id_key(rec["id"])
    if "line" in rec and is_int(rec["line"]):
        return line_key(rec["line"])
    return None


# ---- output --------------------------------------------------------------------------


class Output:
    """The results file: opened (created) once, locked, its partial last line cut off, the
    keys of its records read; `append` writes one whole line and fsyncs it."""

    def __init__(self, path):
        self.path = str(path)
        self._writing = threading.Lock()
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except IsADirectoryError:
            raise UserError(f"--output {path}: is a directory") from None
        except OSError as e:
            raise UserError(f"--output {path}: cannot write ({e.strerror or e})") from None
        try:
            self._lock()
            self.done, self.cut, self.unreadable, self.hashes = self._load()
        except BaseException:
            os.close(self.fd)
            raise

    def _lock(self) -> None:
        try:
            import fcntl  # noqa: PLC0415 (POSIX)
        except ImportError:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"--output {self.path}: another batch job is writing it") from None
        except OSError:
            pass  # a file system without locks: go on unlocked

    def _load(self) -> tuple[dict[str, bool], int, int, dict[str, str]]:
        """({key of each complete record: is it an error}, bytes cut off the end, complete
        lines not ours, {key: the prompt_sha256 its record holds, where it holds one})."""
        chunks = []
        pos = 0
        while True:
            b = os.pread(self.fd, 1 << 20, pos)
            if not b:
                break
            chunks.append(b)
            pos += len(b)
        data = b"".join(chunks)
        keep = data.rfind(b"\n") + 1
        cut = len(data) - keep
        if cut:
            with signals_held():
                os.ftruncate(self.fd, keep)
                os.fsync(self.fd)
        done: dict[str, bool] = {}
        hashes: dict[str, str] = {}
        unreadable = 0
        for raw in data[:keep].split(b"\n")[:-1]:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):
                rec = None
            key = record_key(rec)
            if key is None:
                unreadable += 1
            else:
                done[key] = "error" in rec
                if isinstance(rec.get("prompt_sha256"), str):
                    hashes[key] = rec["prompt_sha256"]
        return done, cut, unreadable, hashes

    def append(self, rec: dict) -> None:
        try:
            line = (json.dumps(rec, ensure_ascii=False, default=_jsonable) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from the input: escaped instead
            line = (json.dumps(rec, default=_jsonable) + "\n").encode("ascii")
        with self._writing, signals_held():  # the job's sessions finish from several threads
            start = os.fstat(self.fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(self.fd, view):]
                os.fsync(self.fd)
            except BaseException:
                os.ftruncate(self.fd, start)  # a full disk: no partial line left behind
                raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _jsonable(v):
    if hasattr(v, "item"):  # a numpy / torch scalar
        return v.item()
    if isinstance(v, (set, tuple)):
        return list(v)
    return str(v)


# ---- progress ------------------------------------------------------------------------
