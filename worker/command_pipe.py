"""The worker's end of its engine process's command pipe: frames written from the event loop in
order, never waiting. What the pipe does not take now waits in a buffer and is written as the pipe
drains (the loop's writer callback). A blocking write froze the worker's loop whenever a step's
commands outgrew the pipe, and deadlocked it with an engine process blocked writing its events
(each waiting for the other to read)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable


class CommandPipe:
    def __init__(self, fd: int) -> None:
        self.fd = fd  # blocking until ``attach`` (the start-up handshake writes before the loop runs)
        self._unsent = bytearray()
        self._lock = threading.Lock()  # ``stop_now`` and ``close`` may come from any thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_error: Callable[[OSError], None] = lambda exc: None
        self._writing = False  # the loop's writer callback is on

    def attach(self, loop: asyncio.AbstractEventLoop, on_error: Callable[[OSError], None]) -> None:
        with self._lock:
            self._loop, self._on_error = loop, on_error
            if self.fd >= 0:
                os.set_blocking(self.fd, False)

    def write(self, data: bytes) -> None:
        """Queue ``data`` behind what is unsent and write what the pipe takes (the event loop's
        thread). ``OSError``: the pipe is closed or its reader gone."""
        with self._lock:
            if self.fd < 0:
                raise OSError("stopped")
            self._unsent += data
            self._flush()

    def write_now(self, data: bytes) -> bool:
        """Write ``data`` whole at once, or nothing (any thread): False behind unsent bytes (part of
        a frame may be in the pipe), with the pipe full, closed, or its reader gone."""
        with self._lock:
            if self.fd < 0 or self._unsent:
                return False
            try:
                n = os.write(self.fd, data)
            except OSError:
                return False
            if n != len(data):  # (a pipe takes a write of at most its buffer whole or not at all)
                self._unsent += data[n:]
                self._flush()
            return True

    def close(self) -> None:
        """Close the pipe (any thread): its reader sees the end of file; unsent bytes are dropped."""
        with self._lock:
            if self.fd < 0:
                return
            if self._writing and self._loop is not None and not self._loop.is_closed():
                try:
                    on_loop = asyncio.get_running_loop() is self._loop
                except RuntimeError:
                    on_loop = False
                if on_loop:
                    self._loop.remove_writer(self.fd)
                else:
                    self._loop.call_soon_threadsafe(self._loop.remove_writer, self.fd)
            self._writing = False
            self._unsent.clear()
            os.close(self.fd)
            self.fd = -1

    def _flush(self) -> None:
        unsent = self._unsent
        while unsent:
            try:
                n = os.write(self.fd, unsent)
            except BlockingIOError:
                break
            del unsent[:n]
        waiting = bool(unsent) and self._loop is not None
        if waiting != self._writing:
            self._writing = waiting
            if waiting:
                self._loop.add_writer(self.fd, self._on_writable)
            else:
                self._loop.remove_writer(self.fd)

    def _on_writable(self) -> None:
        try:
            with self._lock:
                if self.fd >= 0:
                    self._flush()
        except OSError as exc:
            self._on_error(exc)
