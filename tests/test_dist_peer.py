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


def test_writes_run_on_their_own_thread_bounded_and_all_done_at_close(monkeypatch):
    """The owner's writes into peers (exchange._Writes): each lands, at most
    ``_INFLIGHT_BYTES`` of items wait at once, and ``close`` returns only once every
    write is done."""
    import threading
    import time
    monkeypatch.setattr(exchange, "_INFLIGHT_BYTES", 16)
    real, waiting, threads = exchange._write, [], set()

    def slow(offer, idx, whole):
        time.sleep(0.02)                  # the decoder runs ahead, then must wait
        waiting.append(writes.held)
        threads.add(threading.get_ident())
        return real(offer, idx, whole)
    monkeypatch.setattr(exchange, "_write", slow)
    dsts = [torch.zeros(8, dtype=torch.uint8) for _ in range(6)]
    offer = (os.getpid(), {i: (d.data_ptr(), 8) for i, d in enumerate(dsts)})
    writes = exchange._Writes()
    for i in range(6):
        writes.put(offer, i, torch.full((8,), i + 1, dtype=torch.uint8))
    assert writes.close() is None
    assert [d.tolist() for d in dsts] == [[i + 1] * 8 for i in range(6)]
    assert max(waiting) <= 16 and len(waiting) == 6
    assert threads == {writes.thread.ident} != {threading.get_ident()}


def test_a_writer_thread_only_where_the_host_has_a_core_to_spare(monkeypatch):
    from lcckpt.util import pool
    import numpy as np
    ok = np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=bool)   # ranks 0, 1 share a host
    monkeypatch.setattr(pool, "threads", lambda: 1)
    for cpus, me, want in [(2, 0, False), (3, 0, False), (4, 0, True), (2, 2, True),
                           (1, 2, False)]:
        monkeypatch.setattr(pool, "cpus", lambda: cpus)
        assert exchange._spare_cores(ok, me) is want, (cpus, me)
    monkeypatch.setattr(pool, "threads", lambda: 4)
    monkeypatch.setattr(pool, "cpus", lambda: 8)
    assert not exchange._spare_cores(ok, 1)
    monkeypatch.setattr(pool, "cpus", lambda: 10)
    assert exchange._spare_cores(ok, 1)


def test_a_failed_write_is_reported_at_close_and_stops_the_rest():
    dsts = [torch.zeros(4, dtype=torch.uint8) for _ in range(3)]
    offer = (os.getpid(), {0: (dsts[0].data_ptr(), 4), 1: (8, 4), 2: (dsts[2].data_ptr(), 4)})
    writes = exchange._Writes()
    for i in range(3):
        writes.put(offer, i, torch.ones(4, dtype=torch.uint8))
    err = writes.close()
    assert isinstance(err, OSError) and "process_vm_writev" in str(err)
    assert dsts[0].all() and not dsts[2].any()
    assert not writes.thread.is_alive()


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


def _benchmark(script: str, *args: str) -> str:
    """What ``benchmarks/<script>`` prints, run in a fresh interpreter."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "benchmarks", script), *args],
                          capture_output=True, text=True, timeout=300, check=True).stdout


@pytest.mark.slow
def test_the_peer_copy_benchmark_runs():
    out = _benchmark("peer_copy.py", "--mb", "1", "--reps", "1")
    rows = [line.split() for line in out.splitlines() if "buffers" in line or "local" in line]
    assert len(rows) == 5, out
    assert all(float(r[-1]) > 0 for r in rows), out


@pytest.mark.slow
@pytest.mark.parametrize("kind", [(), ("--chain",)], ids=["exact", "chain"])
def test_the_restore_phases_benchmark_times_every_phase_on_both_ranks(kind):
    out = _benchmark("restore_phases.py", "--total-mb", "4", "--repeats", "1", *kind)
    assert ("chain" in out) == bool(kind), out
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()
            if line.split() and line.split()[0] in ("total", "decode", "writes", "give")}
    assert set(rows) == {"total", "decode", "writes", "give"}, out
    assert all(v > 0 for v in rows["total"] + rows["decode"]), out
    assert all(v > 0 for v in rows["give"][1:]), out
    assert sum(rows["writes"][1:]) > 0, out                # copies on one host
    assert "speedup of two ranks" in out


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
