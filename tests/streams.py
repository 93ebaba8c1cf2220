"""Test helpers shared by several test files."""

import io


class NonSeekableStream(io.RawIOBase):
    """A readable, non-seekable binary stream (a pipe or socket, say)."""

    def __init__(self, data):
        self.b = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, out):
        return self.b.readinto(out)
