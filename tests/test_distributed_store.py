"""Distributed checkpoints on fsspec stores: the memory filesystem, and an S3-compatible
server (moto's, started and stopped here; skipped with the reason where it cannot run)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import lcckpt.distributed as ld
from lcckpt.distributed.store import RemoteFiles, files_for
from lcckpt.errors import InvalidArgumentError, StorageError

sys.path.insert(0, os.path.dirname(__file__))
import _dist_worker as W  # noqa: E402

fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed (pip install fsspec)")


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 64, generator=g), "h": torch.randn(64, generator=g).half(),
            "ids": torch.arange(10), "meta": {"epoch": 3, "tag": "run"}}


def _empty():
    return {"w": torch.zeros(300, 64), "h": torch.zeros(64).half(),
            "ids": torch.zeros(10, dtype=torch.int64), "meta": {"epoch": 0, "tag": ""}}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in ("w", "h", "ids")) and a["meta"] == b["meta"]


def _chain_round_trip(url, opts=None, steps=7, every=3, keep=2, kept=(3, 4, 5, 6)):
    """Save ``steps`` steps (a keyframe every ``every``, keep the newest ``keep``), then
    reopen and load each kept step into fresh tensors: it equals the writer's references,
    bit for bit."""
    state = _state()
    ck = ld.DistributedCheckpointer(url, keyframe_every=every, keep_last=keep,
                                    storage_options=opts)
    g = torch.Generator().manual_seed(1)
    refs = {}
    for step in range(steps):
        state["w"] += 0.01 * torch.randn(300, 64, generator=g)
        ck.save(step, state)
        refs[step] = {p.key: t.clone() for p, t in ck.references().items()}
    assert ck.steps() == list(kept)        # the newest, and their chains back to a keyframe
    assert ck.merge() == steps - 1         # the newest made a keyframe on the store, then a
    state["w"] += 0.01 * torch.randn(300, 64, generator=g)      # delta on it: nothing older
    ck.save(steps, state)                                       # is kept
    refs[steps] = {p.key: t.clone() for p, t in ck.references().items()}
    assert ck.steps() == [steps - 1, steps]
    again = ld.DistributedCheckpointer(url, storage_options=opts)
    for step in again.steps():
        target = _empty()
        assert again.load(target, step) == step
        assert torch.equal(target["w"], refs[step]["w"])
        assert target["meta"] == state["meta"]


def test_memory_filesystem_save_load_and_chain_are_bit_exact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"memory://lcckpt-test/{os.getpid()}"
    state = _state()
    ld.save(state, f"{url}/one")
    target = _empty()
    ld.load(target, f"{url}/one")
    assert _same(target, state)
    _chain_round_trip(f"{url}/chain")
    assert os.listdir(tmp_path) == []            # no local folder named "memory:"
    fsspec.filesystem("memory").rm(f"/lcckpt-test/{os.getpid()}", recursive=True)


def test_an_older_step_merges_on_the_memory_filesystem(tmp_path, monkeypatch):
    """merge(step) of a step before the newest, on a store: the later steps' chains are
    rewritten to start at its keyframe, the steps before it go, and every step (a save
    after the merge included) loads back bit for bit."""
    monkeypatch.chdir(tmp_path)
    url = f"memory://lcckpt-test/older{os.getpid()}"
    state, g, refs = _state(), torch.Generator().manual_seed(2), {}
    ck = ld.DistributedCheckpointer(url, keyframe_every=10, keep_last=2)
    for step in range(6):
        state["w"] += 0.01 * torch.randn(300, 64, generator=g)
        ck.save(step, state)
        refs[step] = ck.references()
        if step == 4:
            assert ck.steps() == [0, 1, 2, 3, 4] and ck.merge(2) == 2
            assert ck.steps() == [2, 3, 4]
    assert ck.steps() == [2, 3, 4, 5]
    again = ld.DistributedCheckpointer(url)
    for step in again.steps():
        target = _empty()
        assert again.load(target, step) == step
        assert torch.equal(target["w"], next(t for p, t in refs[step].items() if p.key == "w"))
    assert os.listdir(tmp_path) == []
    fsspec.filesystem("memory").rm(f"/lcckpt-test/older{os.getpid()}", recursive=True)


def test_an_upload_that_lost_bytes_fails_the_save_and_keeps_the_previous(monkeypatch):
    url = f"memory://lcckpt-test/short{os.getpid()}"
    old = _state(0)
    ld.save(old, url)
    real = RemoteFiles.size
    monkeypatch.setattr(RemoteFiles, "size", lambda self, p: real(self, p) - 1)
    with pytest.raises(StorageError, match="the store holds"):
        ld.save(_state(1), url)
    monkeypatch.undo()
    target = _empty()
    ld.load(target, url)
    assert _same(target, old)
    fsspec.filesystem("memory").rm(f"/lcckpt-test/short{os.getpid()}", recursive=True)


def test_urls_without_a_filesystem_and_options_on_paths_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="cannot open 'nosuchproto://x/ck'"):
        ld.save({"w": torch.ones(3)}, "nosuchproto://x/ck")
    with pytest.raises(InvalidArgumentError, match="cannot open"):
        ld.DistributedCheckpointer("nosuchproto://x/ck")
    with pytest.raises(InvalidArgumentError, match="storage_options apply to URLs"):
        ld.save({"w": torch.ones(3)}, tmp_path / "d", storage_options={"key": "k"})
    assert os.listdir(tmp_path) == []


def test_remote_paths_resolve_dot_dot_and_relative_paths_round_trip():
    f = files_for("memory://a/b")
    assert f.join("memory://a/ck/step_2", "../step_1/x.distcp") == "memory://a/ck/step_1/x.distcp"
    assert f.dirname("memory://a/ck/step_2") == "memory://a/ck"
    rel = f.relative("memory://a/ck/step_1/x.distcp", "memory://a/ck/step_2")
    assert rel == "../step_1/x.distcp"
    assert f.join("memory://a/ck/step_2", rel) == "memory://a/ck/step_1/x.distcp"


# -- an S3-compatible server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a local port the kernel picks as it binds (none picked first,
    which another process could take), and storage_options that reach it."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
    server_mod = pytest.importorskip("moto.server",
                                     reason="moto's server is not installed (pip install 'moto[server]')")
    try:
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        port = server.get_host_and_port()[1]
    except Exception as e:                                   # noqa: BLE001
        pytest.skip(f"moto's S3 server did not start: {type(e).__name__}: {e}")
    opts = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}",
                              "region_name": "us-east-1"}}
    import s3fs
    s3fs.S3FileSystem(**opts).call_s3("create_bucket", Bucket="lcckpt-test")
    yield opts
    server.stop()


def test_s3_save_load_and_chain_are_bit_exact(s3):
    state = _state()
    ld.save(state, "s3://lcckpt-test/one", storage_options=s3)
    target = _empty()
    ld.load(target, "s3://lcckpt-test/one", storage_options=s3)
    assert _same(target, state)
    _chain_round_trip("s3://lcckpt-test/chain", s3, steps=4, every=2, keep=1, kept=(2, 3))


_KILLED_MID_UPLOAD = textwrap.dedent("""
    import os, signal, sys, torch
    import s3fs, lcckpt.distributed as ld
    opts = eval(sys.argv[1])
    state = {"w": torch.randn(300, 64, generator=torch.Generator().manual_seed(0))}
    ck = ld.DistributedCheckpointer("s3://lcckpt-test/killed", storage_options=opts)
    ck.save(0, state)
    torch.save(state["w"], sys.argv[2])
    def die(self, final=False):
        os.kill(os.getpid(), signal.SIGKILL)
    s3fs.core.S3File._upload_chunk = die          # the next upload dies half way
    state["w"] += 1
    ck.save(1, state)
""")


@pytest.mark.slow
def test_s3_a_save_killed_mid_upload_leaves_the_previous_step(s3, tmp_path):
    expected = tmp_path / "w0.pt"
    p = subprocess.run([sys.executable, "-c", _KILLED_MID_UPLOAD, repr(s3), str(expected)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    ck = ld.DistributedCheckpointer("s3://lcckpt-test/killed", storage_options=s3)
    assert ck.steps() == [0]                       # no partial step 1 is visible
    target = {"w": torch.zeros(300, 64)}
    assert ck.load(target) == 0
    assert torch.equal(target["w"], torch.load(expected))
    # the next writer starts over from a keyframe and commits step 1
    ck.save(1, {"w": target["w"] + 1})
    again = {"w": torch.zeros(300, 64)}
    assert ck.load(again) == 1 and torch.equal(again["w"], target["w"] + 1)


@pytest.mark.slow
def test_s3_a_failed_upload_on_one_rank_raises_on_every_rank(s3, tmp_path):
    W.spawn(W.s3_failed_upload_worker,
            (2, W.rendezvous(tmp_path), "s3://lcckpt-test/two", s3, str(tmp_path)), 2, str(tmp_path))
    for rank in (0, 1):
        with open(tmp_path / f"raised{rank}") as f:
            assert f.read().startswith("DistributedCheckpointError"), rank
    ck = ld.DistributedCheckpointer("s3://lcckpt-test/two", storage_options=s3)
    assert ck.steps() == [0]
