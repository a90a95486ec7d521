"""Length-prefixed frames on a pipe between a worker and its children, as
multiprocessing's Connection writes them (a 4-byte big-endian length, or -1 and an 8-byte
one), read many at a time: one read() takes every frame that has arrived, where
Connection.recv_bytes() makes two system calls per frame."""

from __future__ import annotations

import os


def frame(payload: bytes) -> bytes:
    n = len(payload)
    head = n.to_bytes(4, "big") if n < 0x7FFFFFFF else b"\xff\xff\xff\xff" + n.to_bytes(8, "big")
    return head + payload


class Reader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()  # what arrived that is not a whole frame yet

    def read(self) -> list[bytes] | None:
        """One read (it blocks if nothing has arrived): the frames now whole, maybe none;
        None once the other end is closed."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        buf = self.buf
        buf += data
        out, i = [], 0
        while len(buf) - i >= 4:
            n, head = int.from_bytes(buf[i:i + 4], "big", signed=True), 4
            if n == -1:
                if len(buf) - i < 12:
                    break
                n, head = int.from_bytes(buf[i + 4:i + 12], "big"), 12
            if len(buf) - i - head < n:
                break
            out.append(bytes(buf[i + head:i + head + n]))
            i += head + n
        del buf[:i]
        return out
