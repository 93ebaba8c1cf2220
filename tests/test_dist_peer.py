"""Same-host copies between ranks (lcckpt/distributed/peer.py) and the size guard of the
cooperative restore's writes; the two-rank restores through them are in
tests/_dist_worker.py::cooperative."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lcckpt.distributed import exchange, peer
from lcckpt.errors import LcckptError

pytestmark = pytest.mark.skipif(peer._libc("process_vm_writev") is None,
                                reason="no process_vm_writev on this platform")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5000), piece=st.integers(1, 700), offset=st.integers(0, 64))
def test_write_then_read_moves_every_byte_in_pieces(n, piece, offset):
    """Into this process's own memory (the kernel allows a process itself), through pieces
    smaller than the copy, so the loop over partial moves is exercised."""
    old, peer._PIECE = peer._PIECE, piece
    try:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n + 2 * offset + 1, dtype=torch.uint8)
        peer.write(os.getpid(), dst.data_ptr() + offset, src)
        assert torch.equal(dst[offset:offset + n], src)
        assert not dst[:offset].any() and not dst[offset + n:].any()    # nothing outside
        back = torch.zeros(n, dtype=torch.uint8)
        peer.read(os.getpid(), dst.data_ptr() + offset, back)
        assert torch.equal(back, src)
    finally:
        peer._PIECE = old


def test_a_bad_address_is_an_os_error_not_a_crash():
    with pytest.raises(OSError, match="process_vm_writev"):
        peer.write(os.getpid(), 8, torch.ones(16, dtype=torch.uint8))     # unmapped page
    with pytest.raises(OSError, match="process_vm_readv"):
        peer.read(os.getpid(), 8, torch.ones(16, dtype=torch.uint8))


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LCCKPT_PEER_COPY", "0")
    with pytest.raises(OSError, match="not available"):
        peer.write(os.getpid(), 8, torch.ones(4, dtype=torch.uint8))


def test_a_write_never_goes_past_the_peers_buffer():
    """A decoded item whose size differs from the buffer the peer offered is an error, and
    nothing is written."""
    dst = torch.zeros(8, dtype=torch.uint8)
    offer = (os.getpid(), {7: (dst.data_ptr(), 4)})
    err = exchange._write(offer, 7, torch.ones(8, dtype=torch.uint8))
    assert isinstance(err, LcckptError) and "decoded 8 bytes" in str(err)
    assert not dst.any()
    assert exchange._write(offer, 7, torch.ones(4, dtype=torch.uint8)) is None
    assert dst.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_a_failed_decode_writes_nothing():
    dst = torch.zeros(4, dtype=torch.uint8)
    assert exchange._write((os.getpid(), {0: (dst.data_ptr(), 4)}), 0, None) is None
    assert not dst.any()


def test_the_probe_checks_both_calls_and_the_token():
    token = torch.randint(0, 256, (16,), dtype=torch.uint8)
    inbox = torch.zeros(16, dtype=torch.uint8)
    want = token.numpy().tobytes()
    assert peer._probe(os.getpid(), token.data_ptr(), inbox.data_ptr(), want)
    assert inbox.numpy().tobytes() == want                        # the write landed
    other = bytes(b ^ 1 for b in want)
    assert not peer._probe(os.getpid(), token.data_ptr(), inbox.data_ptr(), other)
    assert not peer._probe(os.getpid(), 8, inbox.data_ptr(), want)      # unreadable
    assert not peer._probe(os.getpid(), token.data_ptr(), 8, want)      # unwritable


@pytest.mark.slow
def test_the_peer_copy_benchmark_runs():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "peer_copy.py"),
                          "--mb", "1", "--reps", "1"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if "buffers" in line or "local" in line]
    assert len(rows) == 5, out
    assert all(float(r[-1]) > 0 for r in rows), out


def test_the_host_key_names_the_boot_and_the_pid_namespace(monkeypatch):
    """Two processes of one host and one pid namespace agree; another namespace does not."""
    key = peer._host()
    assert key == peer._host()
    real_stat = os.stat

    def other_namespace(path, *a, **kw):
        st = real_stat(path, *a, **kw)
        if path == "/proc/self/ns/pid":
            return os.stat_result((st.st_mode, st.st_ino + 1) + tuple(st)[2:])
        return st
    monkeypatch.setattr(os, "stat", other_namespace)
    assert peer._host() != key
