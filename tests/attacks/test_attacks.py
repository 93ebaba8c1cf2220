"""Each abuse of the format an outside audit found, as a test of how it now fails.

tests/attacks/README.md lists them with the reason each one fails cleanly. Everything
hostile here is built by craft.py with every checksum an attacker can recompute made
valid; loads run in this process except where memory or a second process is the point.
"""

import io
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import lcckpt
from lcckpt import limits
from lcckpt.format.container import read_container
from lcckpt.format.verify import verify_file
from lcckpt.errors import (
    ChecksumError, ConcurrentWriteError, CorruptDataError, InvalidArgumentError, LcckptError,
    NotFoundError, ResourceLimitError,
)

import craft
from helpers import closed_in_child

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _save(obj, path, **kw):
    lcckpt.save(obj, path, **kw)
    return open(path, "rb").read()


# --------------------------------------------------------------------------- 1. swaps


def test_swapping_equal_length_compressed_sections_is_detected(tmp_path):
    """CRC-32 of a blob is content-blind (the blob ends with its own CRC-32); CRC-32C
    seeded with the section's index and name is not."""
    p = tmp_path / "x.lcc"
    raw = _save({"a": torch.zeros(16), "b": torch.ones(16)}, p, compress=True)
    pairs = craft.equal_length_pairs(raw)
    assert pairs == [(0, 1)]
    p.write_bytes(craft.swap(raw, 0, 1))
    with pytest.raises(ChecksumError, match="another section"):
        lcckpt.load(p)
    report = verify_file(p)
    assert not report["ok"] and "ChecksumError" in report["error"]


def test_swapping_equal_content_sections_still_names_them(tmp_path):
    """Identity is bound too: two sections with the same bytes have different checksums."""
    p = tmp_path / "x.lcc"
    raw = _save({"a": torch.ones(16), "b": torch.ones(16)}, p, compress=True)
    with read_container(raw) as c:
        assert c.sections[0]["crc32c"] != c.sections[1]["crc32c"]
    p.write_bytes(craft.swap(raw, 0, 1))       # same bytes: the file is unchanged
    assert verify_file(p)["ok"]


def test_splicing_a_section_from_another_file_is_detected(tmp_path):
    """The same section of the next chain step (same name, same length) does not fit."""
    a, b = tmp_path / "a.lcc", tmp_path / "b.lcc"
    raw_a = _save({"w": torch.zeros(64)}, a, compress=True)
    raw_b = _save({"w": torch.full((64,), 2.0)}, b, compress=True)
    a.write_bytes(craft.splice(raw_a, 0, raw_b, 0))
    with pytest.raises(ChecksumError):
        lcckpt.load(a)
    assert not verify_file(a)["ok"]


def test_splicing_a_blob_header_onto_another_payload_is_detected(tmp_path):
    """Header+CRC of one blob, payload+CRC of another: each inner checksum holds."""
    g = torch.Generator().manual_seed(0)           # incompressible: raw planes, equal sizes
    x, y = (lcckpt.encode(torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32,
                                        generator=g), lossless=True) for _ in range(2))
    spliced = craft.blob_splice(x, y)
    assert spliced is not None and len(spliced) == len(x)
    lcckpt.decode(spliced)                           # a valid blob on its own
    raw = craft.tensor_file(x, [4096], dtype="I32")
    p = tmp_path / "k.lcc"
    p.write_bytes(craft.splice(raw, 0, craft.tensor_file(spliced, [4096], dtype="I32"), 0))
    with pytest.raises(ChecksumError):
        lcckpt.load(p)
    assert not verify_file(p)["ok"]


def test_chain_files_swapped_sections_are_detected(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path, keyframe_every=None, min_delta_elements=16)
    torch.manual_seed(0)
    w = torch.randn(256)
    for step in range(3):
        w = w + 0.01 * torch.randn(256)
        ck.save(step, {"u": w.clone(), "v": 2 * w})   # the same levels at twice the step
    ck.close()
    path = ck.path(2)
    raw = open(path, "rb").read()
    pairs = craft.equal_length_pairs(raw)
    assert pairs, "expected two tracked sections of equal length"
    for i, j in pairs:
        with open(path, "wb") as f:
            f.write(craft.swap(raw, i, j))
        with pytest.raises(LcckptError):
            ck.load(2)
        assert not verify_file(path)["ok"]


def test_version_1_files_still_load_and_verify_warns():
    v1 = os.path.join(ROOT, "tests", "fixtures", "v1", "compressed.lcc")
    lcckpt.load(v1)
    report = verify_file(v1)
    assert report["ok"] and report["version"] == 1 and "version 1" in report["warnings"][0]


# --------------------------------------------------------------------------- 2. bombs


def test_a_600_byte_file_declaring_2_gib_is_refused_before_decoding():
    raw = craft.tensor_file(craft.const_blob([2**29]), [2**29])
    assert len(raw) < 700
    with pytest.raises(ResourceLimitError, match="max_bytes=None"):
        lcckpt.load(io.BytesIO(raw))


def test_a_lossy_bomb_in_a_delta_section_is_refused():
    raw = craft.tensor_file(craft.const_blob([3 * 2**28], lossy=True), [3 * 2**28],
                            codec="delta")
    with pytest.raises(ResourceLimitError):
        lcckpt.load(io.BytesIO(raw))


def test_a_blob_larger_than_its_declared_shape_is_refused_before_decoding():
    """The section says 16 elements (within any limit); its blob says 2**26."""
    raw = craft.tensor_file(craft.const_blob([2**26]), [2**26], meta_shape=[16])
    with pytest.raises(CorruptDataError, match="does not hold"):
        lcckpt.load(io.BytesIO(raw))


def test_the_limit_is_one_argument_away():
    raw = craft.tensor_file(craft.const_blob([2**20], log2=18), [2**20])   # 4 MiB of zeros
    with pytest.raises(ResourceLimitError):
        lcckpt.load(io.BytesIO(raw), max_bytes=1 << 20)
    assert lcckpt.load(io.BytesIO(raw), max_bytes=4 << 20)["t"].abs().sum() == 0
    assert lcckpt.load(io.BytesIO(raw), max_bytes=None)["t"].numel() == 2**20
    old = limits.set_max_bytes(1 << 20)
    try:
        with pytest.raises(ResourceLimitError):
            lcckpt.load(io.BytesIO(raw))
    finally:
        limits.set_max_bytes(old)
    with pytest.raises(InvalidArgumentError):
        lcckpt.load(io.BytesIO(raw), max_bytes=-1)


def test_uncompressed_files_always_fit_the_default_limit(tmp_path):
    p = tmp_path / "big.lcc"
    lcckpt.save({"w": torch.randn(200 * 2**10, 256)}, p)      # 200 MiB > the 192 MiB floor
    report = verify_file(p)
    assert report["ok"] and report["expansion"] <= 1.0
    assert lcckpt.load(p)["w"].shape == (200 * 2**10, 256)


def test_chain_load_counts_the_chain_as_a_whole(tmp_path):
    """Deltas of a mostly frozen model expand a lot per file, but only into references the
    keyframe already holds: the chain's total size is the base of the limit."""
    ck = lcckpt.DeltaCheckpointer(tmp_path, keyframe_every=None, min_delta_elements=16)
    frozen = torch.randn(1 << 20)
    for step in range(3):
        ck.save(step, {"frozen": frozen, "step": step})
    ck.close()
    assert os.path.getsize(ck.path(2)) * limits.AUTO_EXPANSION < (4 << 20) + os.path.getsize(ck.path(0))
    assert ck.load(2)["step"] == 2
    with pytest.raises(ResourceLimitError):
        ck.load(2, max_bytes=1 << 20)


def test_a_delta_far_smaller_than_its_state_loads_at_the_default(tmp_path, monkeypatch):
    """A delta of a large state is 100-1000x smaller than the state: once its keyframe is
    in the chain, the tensors it updates in place do not count against the delta's own
    size, also when replay continues from an earlier step (one file at a time). Scaled
    down: a 2 MiB floor stands for the 192 MiB one."""
    monkeypatch.setattr(limits, "AUTO_FLOOR", 2 << 20)
    ck = lcckpt.DeltaCheckpointer(tmp_path, keyframe_every=None)
    w = torch.randn(1 << 20)                  # 4 MiB: over the floor, a keyframe fits
    key = w.clone()
    for step in range(4):
        w[step * 64:(step + 1) * 64] += 1.0   # a few rows move: a tiny delta
        ck.save(step, {"w": w.clone(), "step": step})
        if step == 0:
            key = w.clone()
    ck.close()
    assert os.path.getsize(ck.path(3)) * limits.AUTO_EXPANSION < (2 << 20)
    restored = ck.load(3)["w"]
    assert float((restored - w).norm()) <= 0.0101 * float((w - key).norm())
    assert sorted(s for s, _ in ck.replay()) == [0, 1, 2, 3]
    with pytest.raises(ResourceLimitError):   # an explicit limit still counts everything
        ck.load(3, max_bytes=3 << 20)


def test_a_delta_cannot_bring_a_large_new_tensor_past_the_limit(tmp_path, monkeypatch):
    """What a delta brings anew (a tensor absent from the keyframe, coded against zeros)
    is not vouched for by the chain: it counts against the files' stored size. (The
    writer keeps its own files loadable, tests/test_zeros.py: the floor is lowered after
    the saves, so that the file stands for one crafted to pass the writer's rule.)"""
    ck = lcckpt.DeltaCheckpointer(tmp_path, keyframe_every=None)
    ck.save(0, {"w": torch.randn(1000)})
    ck.save(1, {"w": torch.randn(1000), "new": torch.ones(1 << 21)})    # 8 MiB of ones
    # (zeros would load: stored as "zeros", they load as untouched pages, tests/test_zeros.py)
    ck.close()
    assert os.path.getsize(ck.path(1)) < 100_000                       # coded to little
    monkeypatch.setattr(limits, "AUTO_FLOOR", 1 << 20)
    with pytest.raises(ResourceLimitError):
        ck.load(1)


# The child's own peak resident memory. Not ``ru_maxrss``: Linux carries the parent's peak
# into a child across fork/vfork and exec, so a large pytest process would be reported as
# the child's. ``VmHWM`` belongs to the address space the exec created.
_PRINT_PEAK = """
try:
    with open("/proc/self/status") as _f:
        print(next(int(l.split()[1]) for l in _f if l.startswith("VmHWM:")))
except (OSError, StopIteration):
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

_RSS_CHILD = """
import io, resource, sys
sys.path[:0] = sys.argv[1:3]
import craft, lcckpt
from lcckpt import limits
from lcckpt.codec import dtypes
dtype, codec, scale = sys.argv[3], sys.argv[4], float(sys.argv[5])
pad = 1_000_000 - 4096                 # a file just under 1 MB: the largest "auto" limit
limit = limits.AUTO_FLOOR + limits.AUTO_EXPANSION * (pad + 1024)
weight = dtypes.BY_NAME[dtype].numpy.itemsize * (3 if dtype in ("F16", "BF16") and codec == "delta" else 1)
n = int((limit - pad) * scale) // weight // 4096 * 4096
meta = {"kind": "tensor", "dtype": dtype, "shape": [n], "nbytes": n * dtypes.BY_NAME[dtype].numpy.itemsize,
        "codec": codec, "device": "cpu", "codec_params": {"key": "t"}}
raw = craft.container([("t", meta, craft.const_blob([n], dtype)), ("pad", {"kind": "bytes"}, bytes(pad))],
                      {"$": "tuple", "v": [{"$": "tensor", "s": 0}, {"$": "bytes", "s": 1}]})
assert len(raw) < 1_000_000, len(raw)
try:
    out = lcckpt.load(io.BytesIO(raw))
    assert out[0].shape == (n,)
    print("loaded")
except lcckpt.LcckptError as e:
    print(type(e).__name__)
"""+_PRINT_PEAK


def _child(code: str, *args) -> list[str]:
    """Run ``code`` in a fresh interpreter with this checkout on its path; its stdout words."""
    out = subprocess.run([sys.executable, "-c", code, HERE, ROOT, *map(str, args)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def _assert_loads_under_1_gb(code: str, args: list, scale: float) -> None:
    """Under the limit (``scale < 1``) the child loads, with a peak RSS under 1 GB; past it
    the load is refused."""
    outcome, rss_kib = _child(code, *args, scale)
    assert outcome == ("loaded" if scale < 1 else "ResourceLimitError")
    assert int(rss_kib) * 1024 < 1e9, f"peak RSS {int(rss_kib) // 1024} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("dtype,codec,scale", [
    ("F32", "lossless", 0.99), ("BF16", "delta", 0.99), ("F64", "delta", 0.99),
    ("F32", "lossless", 1.05),
])
def test_no_file_under_1_mb_makes_a_default_load_use_1_gb(dtype, codec, scale):
    """The largest bomb a file under 1 MB may hold by default loads in a child process
    whose peak resident memory (interpreter, torch and Numba included) stays under 1 GB;
    a slightly larger one is refused."""
    _assert_loads_under_1_gb(_RSS_CHILD, [dtype, codec], scale)


def test_a_header_of_millions_of_empty_lists_is_refused_before_parsing():
    header = b'{"version":2,"meta":{"x":[' + b"[]," * 3_000_000 + b'[]]},"sections":[]}'
    with pytest.raises(ResourceLimitError, match="could take gigabytes"):
        read_container(craft.raw_header_file(header))    # by counting, before any parse


# --------------------------------------------------------------------------- 3. crafted headers


@pytest.fixture
def one_tensor(tmp_path):
    return _save({"t": torch.ones(4)}, tmp_path / "t.lcc")


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**63 - 1], [2**49], [2**30, 2**30]])
def test_absurd_shapes_are_corrupt_data(one_tensor, shape):
    raw = craft.with_section_meta(one_tensor, 0, shape=shape, nbytes=0)
    with pytest.raises(CorruptDataError, match="shape"):
        lcckpt.load(io.BytesIO(raw))


@pytest.mark.parametrize("device", ["hpu", "privateuseone", "meta", "xla:0", "lazy"])
def test_unknown_saved_devices_are_refused_without_importing_anything(one_tensor, device):
    raw = craft.with_section_meta(one_tensor, 0, device=device)
    before = set(sys.modules)
    with pytest.raises(InvalidArgumentError, match="map_location"):
        lcckpt.load(io.BytesIO(raw))
    assert set(sys.modules) == before
    out = lcckpt.load(io.BytesIO(raw), map_location={device: "cpu"})    # mapped: loads
    assert torch.equal(out["t"], torch.ones(4))
    assert torch.equal(lcckpt.load(io.BytesIO(raw), map_location="cpu")["t"], torch.ones(4))


@pytest.mark.parametrize("device", ["CUDA", "cuda:-1", "cuda:0:1", "", "x" * 100, 7])
def test_malformed_devices_are_corrupt_data(one_tensor, device):
    raw = craft.with_section_meta(one_tensor, 0, device=device)
    with pytest.raises(CorruptDataError):
        lcckpt.load(io.BytesIO(raw))


@pytest.mark.parametrize("v", [[2**63], [-(2**63) - 1], [1] * 65])
def test_torch_size_values_that_break_repr_are_refused(one_tensor, v):
    raw = craft.with_tree(one_tensor, {"$": "size", "v": v})
    with pytest.raises(CorruptDataError):
        lcckpt.load(io.BytesIO(raw))
    ok = lcckpt.load(io.BytesIO(craft.with_tree(one_tensor, {"$": "size", "v": [2**63 - 1]})))
    assert repr(ok)


def test_an_int_too_long_to_print_is_refused(one_tensor):
    """Found by fuzz_large.py: a 5,000-hex-digit int loaded, then repr() raised."""
    raw = craft.with_tree(one_tensor, {"$": "int", "hex": "0x" + "f" * 5000})
    with pytest.raises(CorruptDataError, match="hex digits"):
        lcckpt.load(io.BytesIO(raw))
    assert repr(lcckpt.load(io.BytesIO(craft.with_tree(one_tensor, {"$": "int", "hex": "0x" + "f" * 3000}))))


# --------------------------------------------------------------------------- 4. writers


_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[2])
import torch, lcckpt
ck = lcckpt.DeltaCheckpointer(sys.argv[1])
ck.save(0, {"w": torch.zeros(10)})
print("locked", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_second_writer_process_is_refused_at_once(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), ROOT],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n"
        ck = lcckpt.DeltaCheckpointer(tmp_path)
        with pytest.raises(ConcurrentWriteError, match=f"pid {child.pid}"):
            ck.save(1, {"w": torch.ones(10)})  # while the holder lives: no waiting for it
        assert child.poll() is None
        assert ck.steps() == [0] and torch.equal(ck.load(0)["w"], torch.zeros(10))
    finally:
        child.kill()
        child.wait()
    ck.save(1, {"w": torch.ones(10)})          # the dead writer's lock is stale: taken over
    assert torch.equal(ck.load(1)["w"], torch.ones(10))
    ck.close()


def test_a_second_writer_object_and_a_second_thread_are_refused(tmp_path):
    a = lcckpt.DeltaCheckpointer(tmp_path, min_delta_elements=1)
    a.save(0, {"w": torch.zeros(10)})
    b = lcckpt.DeltaCheckpointer(tmp_path)
    with pytest.raises(ConcurrentWriteError):
        b.save(1, {"w": torch.ones(10)})
    with pytest.raises(ConcurrentWriteError):
        b.merge(0)
    del a                                       # dropping the writer releases the lock
    b.save(1, {"w": torch.ones(10)})
    b.close()

    ck = lcckpt.DeltaCheckpointer(tmp_path / "t", min_delta_elements=1)
    big = {"w": torch.randn(2**22)}
    errors, done = [], []

    def worker(start):
        for step in range(start, start + 40, 2):
            try:
                ck.save(step, big)
                done.append(step)
            except ConcurrentWriteError as e:
                errors.append(e)
            except InvalidArgumentError:    # the other thread got ahead: steps must increase
                pass

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ck.close()
    assert errors, "two threads saving at once were never refused"
    reader = lcckpt.DeltaCheckpointer(tmp_path / "t")
    assert reader.steps() == sorted(done)
    for step in reader.steps():                 # every save that reported success loads
        reader.load(step)


# --------------------------------------------------------------------------- 5. errors


def test_missing_things_are_lcckpt_errors_naming_the_path(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    with pytest.raises(NotFoundError, match="does not exist"):
        ck.load()
    (tmp_path / "ck").mkdir()
    with pytest.raises(NotFoundError, match="empty"):
        ck.load()
    (tmp_path / "ck" / "notes.txt").write_text("x")
    with pytest.raises(NotFoundError, match="right directory"):
        ck.load()
    ck.save(3, {"w": torch.zeros(2)})
    with pytest.raises(NotFoundError, match="step 999") as e:
        ck.load(999)
    assert isinstance(e.value, FileNotFoundError) and "step-000000000999" in str(e.value)
    with pytest.raises(NotFoundError):
        ck.info(999)
    ck.close()
    missing = tmp_path / "no" / "such" / "x.lcc"
    with pytest.raises(NotFoundError, match="does not exist") as e:
        lcckpt.save({"a": 1}, missing)
    assert str(missing) in str(e.value) and "lcckpt-tmp" not in str(e.value)
    with pytest.raises(NotFoundError) as e:
        lcckpt.load(missing)
    assert str(missing) in str(e.value)


def test_corruption_errors_name_the_file(tmp_path):
    p = tmp_path / "x.lcc"
    raw = bytearray(_save({"a": torch.zeros(16)}, p, compress=True))
    raw[-3] ^= 1
    p.write_bytes(raw)
    with pytest.raises(ChecksumError, match=str(p)):
        lcckpt.load(p)


# --------------------------------------------------------------------------- 6. growth


def test_temp_files_of_killed_saves_are_removed_by_any_later_save(tmp_path):
    from lcckpt.util import durable as _durable
    dead = f".big.lcc.{_durable._host_tag()}-999999999-abcd1234{_durable.TEMP_SUFFIX}"
    (tmp_path / dead).write_bytes(b"x" * 1000)
    lcckpt.save({"a": 1}, tmp_path / "other.lcc")
    assert sorted(os.listdir(tmp_path)) == ["other.lcc"]


def test_a_symlinked_writer_lock_is_refused_and_its_target_untouched(tmp_path):
    """A link planted as the lock file in a shared directory must not make the writer
    truncate and overwrite the file it points to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    d = tmp_path / "ck"
    d.mkdir()
    os.symlink(victim, d / ".lcckpt-writer.lock")
    with pytest.raises(lcckpt.StorageError, match="symbolic link"):
        with lcckpt.DeltaCheckpointer(d) as ck:
            ck.save(0, {"w": torch.randn(100)})
    assert victim.read_text() == "precious\n"
    assert not list(d.glob("step-*"))


def test_a_writer_lock_that_is_not_a_regular_file_is_refused(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    os.mkfifo(d / ".lcckpt-writer.lock")
    with pytest.raises(lcckpt.StorageError, match="not a regular file"):
        lcckpt.DeltaCheckpointer(d).save(0, {"w": torch.randn(100)})


def _deflated_torch_file(path, n_bytes):
    """torch.save of zeros, its members then deflated: a small file that inflates to
    ``n_bytes`` (torch reads compressed members as readily as stored ones)."""
    import zipfile
    plain = io.BytesIO()
    torch.save({"w": torch.zeros(n_bytes // 4)}, plain)
    plain.seek(0)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return path


def test_a_torch_zip_bomb_is_held_to_max_bytes(tmp_path, monkeypatch):
    bomb = _deflated_torch_file(tmp_path / "bomb.pt", 16 << 20)
    assert os.path.getsize(bomb) < 100_000
    for src in (str(bomb), io.BytesIO(bomb.read_bytes())):
        with pytest.raises(ResourceLimitError, match="torch.save"):
            lcckpt.load(src, max_bytes=10**6)
    monkeypatch.setattr(limits, "AUTO_FLOOR", 1 << 20)     # the default, scaled down
    with pytest.raises(ResourceLimitError):
        lcckpt.load(str(bomb))
    assert lcckpt.load(str(bomb), max_bytes=None)["w"].numel() == 4 << 20
    plain = tmp_path / "plain.pt"                 # torch.save's own files always fit
    torch.save({"w": torch.zeros(4 << 20)}, plain)
    assert lcckpt.load(str(plain))["w"].numel() == 4 << 20


def test_a_tiny_blob_of_a_huge_constant_is_held_to_max_bytes(monkeypatch):
    """``lcckpt.decode`` trusts its caller by default; with ``max_bytes``, and always in
    the numcodecs codecs (zarr hands them bytes from anywhere), the header's declared size
    is checked before anything is allocated."""
    from lcckpt.numcodecs import LcckptLossless, LcckptLossy
    monkeypatch.setattr(limits, "AUTO_FLOOR", 1 << 20)      # the default, scaled down
    big = np.zeros(1 << 22, np.float32)                        # 16 MiB
    exact = lcckpt.encode(big, lossless=True)
    lossy = lcckpt.encode(big, bits=2)
    assert len(exact) < 10_000 and len(lossy) < 10_000
    for blob in (exact, lossy):
        with pytest.raises(ResourceLimitError):
            lcckpt.decode(blob, max_bytes=limits.DEFAULT)
        with pytest.raises(ResourceLimitError):
            lcckpt.decode(blob, max_bytes=10**6)
        assert lcckpt.decode(blob).size == big.size            # the trusting default
    for codec, blob in ((LcckptLossless(), exact), (LcckptLossy(), lossy)):
        with pytest.raises(ResourceLimitError):
            codec.decode(blob)
        out = np.empty_like(big)                               # a caller's buffer: no check
        codec.decode(blob, out=out)


def test_a_symlinked_foreign_step_is_not_a_step(tmp_path, capsys):
    """A link named like the newest step, pointing at another run's file, must not be
    taken for a step: retention would otherwise delete the run's own steps below it.
    verify names it."""
    from lcckpt.cli import main
    other = lcckpt.DeltaCheckpointer(tmp_path / "other")
    other.save(99, {"w": torch.randn(100)})
    other.close()
    ck = lcckpt.DeltaCheckpointer(tmp_path / "run", keep_last=2)
    ck.save(0, {"w": torch.randn(100)})
    ck.save(1, {"w": torch.randn(100)})
    os.symlink(other.path(99), ck.path(50))
    assert ck.steps() == [0, 1] and ck.strays() == [ck.path(50)]
    ck.save(2, {"w": torch.randn(100)})
    assert ck.steps() == [0, 1, 2]                 # keep_last=2 needs the whole chain
    ck.close()
    assert main(["verify", str(tmp_path / "run")]) == 1
    assert "not a regular file" in capsys.readouterr().err
    os.unlink(ck.path(50))
    assert main(["verify", str(tmp_path / "run")]) == 0


_MEMORY_CHILD = """
import io, resource, sys
sys.path[:0] = sys.argv[1:3]
import torch, lcckpt
from lcckpt import limits
buf = io.BytesIO()
lcckpt.save({"w": torch.randn(64 << 20)}, buf)          # 256 MiB, stored as it is
vm = int([x for x in open("/proc/self/status") if x.startswith("VmSize:")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (128 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
mem = limits.usable_memory()
try:
    lcckpt.load(io.BytesIO(buf.getvalue()))
    print("loaded", mem[1])
except lcckpt.ResourceLimitError as e:
    print("ResourceLimitError", mem[1], "would not fit" in str(e))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_auto_refuses_what_would_not_fit_under_rlimit_as():
    """An uncompressed 256 MiB file is within the ratio rule; with 128 MiB of address
    space left, "auto" refuses it up front, naming the bound, instead of failing inside
    the decoder."""
    assert _child(_MEMORY_CHILD) == ["ResourceLimitError", "RLIMIT_AS", "True"]


def test_usable_memory_is_the_least_bound(monkeypatch):
    monkeypatch.setattr(limits, "_available_ram", lambda: (8 << 30, "available RAM"))
    monkeypatch.setattr(limits, "_cgroup_left", lambda: (3 << 30, "the cgroup's memory limit"))
    monkeypatch.setattr(limits, "_rlimit_left", lambda: None)
    assert limits.usable_memory() == (3 << 30, "the cgroup's memory limit")
    assert limits.resolve("auto", 1 << 30) == 3 << 30           # memory binds
    assert limits.resolve("auto", 1 << 20) == (192 << 20) + 32 * (1 << 20)   # the ratio does
    assert limits.resolve(5, 1 << 30) == 5                       # an explicit limit is kept
    for f in ("_available_ram", "_cgroup_left"):
        monkeypatch.setattr(limits, f, lambda: None)
    assert limits.usable_memory() is None
    assert limits.resolve("auto", 1 << 30) == (192 << 20) + 32 * (1 << 30)


def test_small_loads_are_not_held_against_the_memory_left(monkeypatch):
    """Under "auto", a load of at most AUTO_SMALL is checked against the ratio rule
    alone (no /proc reads per lazy row read); a larger one against the memory left."""
    reads = []
    monkeypatch.setattr(limits, "_available_ram", lambda: reads.append(1) or (1 << 20, "available RAM"))
    monkeypatch.setattr(limits, "_cgroup_left", lambda: None)
    monkeypatch.setattr(limits, "_rlimit_left", lambda: None)
    limits.check(limits.AUTO_SMALL, 1 << 10, "auto", "a slice")
    assert reads == []
    with pytest.raises(lcckpt.ResourceLimitError, match="available RAM leaves"):
        limits.check(limits.AUTO_SMALL + 1, 1 << 10, "auto", "a slice")
    assert reads == [1]


def test_a_flipped_bit_in_torch_data_fails_verify(tmp_path):
    """torch.load does not check a zip member's CRC-32, so a flipped bit in tensor data
    loads as other numbers; ``lcckpt verify`` checks every CRC (found by fuzz_large.py)."""
    from lcckpt.cli import main
    from lcckpt.errors import ChecksumError
    path = tmp_path / "a.pt"
    w = torch.arange(1000.0)
    torch.save({"w": w}, path)
    assert main(["verify", str(path)]) == 0
    raw = bytearray(path.read_bytes())
    raw[raw.find(w.numpy().tobytes()[400:408])] ^= 1
    path.write_bytes(bytes(raw))
    assert not torch.equal(lcckpt.load(str(path))["w"], w)     # what torch itself gives
    assert main(["verify", str(path)]) == 1
    from lcckpt.interop.convert import check_torch_crcs
    with pytest.raises(ChecksumError, match="CRC-32"):
        check_torch_crcs(path)
    old = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)                # a file without CRCs
    try:
        torch.save({"w": w}, path)
    finally:
        torch.serialization.set_crc32_options(old)
    assert main(["verify", str(path)]) == 0


@pytest.mark.parametrize("field,value", [(6, 64), (8, 0x40), (10, 99)],
                         ids=["zip-version-6.4", "strong-encryption", "compression-99"])
def test_zip_features_torch_never_writes_are_damage_not_other_errors(tmp_path, field, value):
    """One flipped byte of a torch.save zip's directory made Python's zipfile raise
    NotImplementedError, past the LcckptError hierarchy, from load and verify (found by
    fuzz_large.py). torch itself loads the first file; its members' sizes would go
    unchecked against the limit, so it is refused as damaged."""
    from lcckpt.interop.convert import check_torch_crcs
    path = tmp_path / "a.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    raw = bytearray(path.read_bytes())
    raw[raw.find(b"PK\x01\x02") + field] = value         # the first central directory entry
    path.write_bytes(bytes(raw))
    with pytest.raises(lcckpt.CorruptDataError):
        lcckpt.load(str(path))
    with pytest.raises(lcckpt.CorruptDataError):
        check_torch_crcs(path)


def _directory_entry(raw: bytes, suffix: bytes) -> int:
    """Where the central directory entry of the zip member named ``...suffix`` starts."""
    entry = raw.find(b"PK\x01\x02")
    while not raw[entry + 46:entry + 46 + raw[entry + 28]].endswith(suffix):
        entry = raw.find(b"PK\x01\x02", entry + 4)
        assert entry > 0, suffix
    return entry


def test_a_member_marked_a_directory_is_damage_not_other_data(tmp_path):
    """A flipped bit in a member's external attributes (the DOS directory bit) made torch's
    zip reader take the member for a directory with no data, and load other numbers,
    while Python's zipfile, which ignores the bit, found every CRC right: the file loaded
    wrong and passed verify (found by fuzz_large.py)."""
    from lcckpt.cli import main
    path = tmp_path / "a.pt"
    w = torch.arange(1000.0)
    torch.save({"w": w}, path)
    raw = bytearray(path.read_bytes())
    entry = _directory_entry(raw, b"/data/0")               # the tensor's
    raw[entry + 38] |= 0x10                                  # external attributes
    path.write_bytes(bytes(raw))
    torch.load(path)        # torch itself raises nothing (its tensor holds no data of the
    # member: memory a freed tensor left, at times the very numbers, so it is not compared)
    with pytest.raises(lcckpt.CorruptDataError, match="directory"):
        lcckpt.load(str(path))
    with pytest.raises(lcckpt.CorruptDataError, match="directory"):
        lcckpt.load(io.BytesIO(bytes(raw)))
    assert main(["verify", str(path)]) == 1


def test_a_compressed_member_is_read_through_its_crc_before_torch_reads_it(tmp_path):
    """torch's zip reader inflates a member without checking its CRC-32: the compression
    method of a stored member flipped to deflate loaded zeros (found by
    torch_zip_sweep.py). torch.save stores every member, so a compressed one (a re-zipped
    file, or that flip) is read to its end before the load, which checks its CRC-32."""
    w = torch.arange(1000.0)
    path = tmp_path / "a.pt"
    torch.save({"w": w}, path)
    raw = bytearray(path.read_bytes())
    entry = _directory_entry(raw, b"/data/0")               # the tensor's
    raw[entry + 10] |= 0x08                                 # method: stored -> deflated
    path.write_bytes(bytes(raw))
    torch.load(path)        # torch itself raises nothing (its tensor holds whatever the
    # failed inflate left: zeros, or memory a freed tensor left, so it is not compared)
    with pytest.raises((lcckpt.ChecksumError, lcckpt.CorruptDataError), match="data/0"):
        lcckpt.load(str(path))
    rezipped = _deflated_torch_file(tmp_path / "z.pt", 1 << 16)   # valid, deflated
    assert torch.equal(lcckpt.load(str(rezipped))["w"], torch.zeros(1 << 14))


def test_a_local_header_torch_would_misread_is_damage(tmp_path):
    """torch's reader finds a member's data by its local header's lengths: a name one byte
    longer loaded other numbers (found by torch_zip_sweep.py). Each stored member's local
    header is read before the load; it must name the member the directory names."""
    import zipfile
    w = torch.arange(1000.0)
    path = tmp_path / "a.pt"
    torch.save({"w": w}, path)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        h = next(i for i in z.infolist() if i.filename.endswith("/data/0")).header_offset
    raw[h + 26] += 1                                        # the local name's length
    path.write_bytes(bytes(raw))
    assert not torch.equal(torch.load(path)["w"], w)        # what torch itself gives
    with pytest.raises(lcckpt.ChecksumError, match="data/0"):
        lcckpt.load(str(path))


_RSS_FOREIGN = """
import io, resource, sys, zipfile
sys.path[:0] = sys.argv[1:3]
import numpy as np, torch, craft, lcckpt
from lcckpt import limits
fmt, scale = sys.argv[3], float(sys.argv[4])
size = 1_000_000 - 4096                  # a file just under 1 MB
n = int((limits.AUTO_FLOOR + limits.AUTO_EXPANSION * size) * scale) // 4096 * 4096
try:
    if fmt == "torch":                   # a deflated zip of zeros, padded to the size
        plain = io.BytesIO()
        torch.save({"w": torch.zeros(n, dtype=torch.uint8)}, plain)
        plain.seek(0)
        raw = io.BytesIO()
        with zipfile.ZipFile(plain) as src, zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info.filename))
            dst.writestr(info.filename.split("/")[0] + "/pad",     # torch's own folder
                         np.random.default_rng(0).bytes(size - raw.tell() - 4096),
                         zipfile.ZIP_STORED)
        data = raw.getvalue()
        del plain
        assert len(data) < 1_000_000, len(data)
        out = lcckpt.load(io.BytesIO(data))["w"]
    else:                                # a blob handed to the numcodecs codec
        from lcckpt.numcodecs import LcckptLossless
        probe = len(craft.const_blob([1 << 20], "F32"))    # hardly depends on the size
        n = int((limits.AUTO_FLOOR + limits.AUTO_EXPANSION * probe) * scale) // 4 // 4096 * 4096
        out = LcckptLossless().decode(craft.const_blob([n], "F32"))
    print("loaded")
except lcckpt.LcckptError as e:
    print(type(e).__name__)
"""+_PRINT_PEAK


@pytest.mark.slow
@pytest.mark.parametrize("fmt,scale", [("torch", 0.99), ("torch", 1.05), ("numcodecs", 0.99),
                                       ("numcodecs", 1.05)])
def test_no_torch_zip_or_raw_blob_under_1_mb_makes_a_default_load_use_1_gb(fmt, scale):
    """The rule of lcckpt files for the other ways bytes come in: a deflated torch.save zip
    under 1 MB, and a tiny blob handed to the numcodecs codec (zarr's path for remote
    bytes): the largest one allowed loads under 1 GB of peak RSS, a larger one is refused."""
    _assert_loads_under_1_gb(_RSS_FOREIGN, [fmt], scale)


def test_lazy_reads_are_held_to_max_bytes(tmp_path, monkeypatch):
    """``lcckpt.open`` follows the rule of ``load``: a bomb's tensor is refused by
    ``get_tensor`` and ``get_slice`` at the default, read with ``max_bytes=None``; a chain
    step's delta tensor is checked with its chain's files, as ``DeltaCheckpointer.load``."""
    monkeypatch.setattr(limits, "AUTO_FLOOR", 1 << 20)        # the default, scaled down
    n = 1 << 22                                              # 16 MiB of constant
    path = tmp_path / "bomb.lcc"
    path.write_bytes(craft.tensor_file(craft.const_blob([n]), [n]))
    with lcckpt.open(path) as f:
        with pytest.raises(ResourceLimitError, match="declares"):
            f.get_tensor("t")
        with pytest.raises(ResourceLimitError, match="declares"):
            f.get_slice("t")[:4]
    with lcckpt.open(path, max_bytes=None) as f:
        assert f.get_slice("t")[:4].tolist() == [0.0] * 4
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    for step in range(3):
        ck.save(step, {"w": torch.full((1 << 16,), float(step)), "b": torch.ones(3)})
    with lcckpt.open(tmp_path / "ck", max_bytes=1000) as f:
        with pytest.raises(ResourceLimitError):
            f.get_tensor("w")
    with lcckpt.open(tmp_path / "ck") as f:                 # "auto": the deltas are vouched for
        assert torch.equal(f.get_tensor("w"), ck.load(2)["w"])


@pytest.mark.parametrize("code", ["ENOLCK", "ENOSYS", "EOPNOTSUPP"])
def test_a_filesystem_without_locks_saves_with_a_warning(tmp_path, monkeypatch, code):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    ck = lcckpt.DeltaCheckpointer(tmp_path, min_delta_elements=1)
    with pytest.warns(RuntimeWarning, match="does not support file locks"):
        ck.save(0, {"w": torch.zeros(10)})
    ck.save(1, {"w": torch.ones(10)})
    assert ck.steps() == [0, 1] and torch.equal(ck.load(1)["w"], torch.ones(10))
    ck.close()


def test_a_lock_that_fails_otherwise_is_a_storage_error(tmp_path, monkeypatch):
    import errno
    import fcntl

    def broken(fd, op):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(lcckpt.StorageError, match="cannot lock the checkpoint directory"):
        lcckpt.DeltaCheckpointer(tmp_path).save(0, {"w": torch.zeros(10)})


def test_a_forked_child_does_not_keep_the_writer_lock(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path)
    ck.save(0, {"w": torch.zeros(10)})
    assert closed_in_child(ck._lock.fd)         # a DataLoader worker, say
    ck.close()


_DIES_WITH_A_CHILD = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
import torch, lcckpt
ck = lcckpt.DeltaCheckpointer(sys.argv[1])
ck.save(0, {"w": torch.zeros(10)})
child = os.fork()
if child == 0:              # a worker that outlives the writer for a while
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
os._exit(0)                 # the writer dies without releasing its lock
"""


@pytest.mark.slow
def test_a_writer_that_died_leaving_a_child_does_not_block_the_next(tmp_path):
    p = subprocess.run([sys.executable, "-c", _DIES_WITH_A_CHILD, str(tmp_path), ROOT],
                       capture_output=True, text=True, timeout=300)
    child = int(p.stdout)
    try:
        os.kill(child, 0)                       # still alive, holding a copy of the fd
        ck = lcckpt.DeltaCheckpointer(tmp_path)
        ck.save(1, {"w": torch.ones(10)})      # the lock is stale all the same
        assert ck.steps() == [0, 1]
        ck.close()
    finally:
        os.kill(child, signal.SIGKILL)
