"""What a save does to the name it is given: a symbolic link is followed as torch.save's
open follows it (the link stays, the file it names is replaced), the replaced file's
permission bits and owner stay, and a chain's steps never follow a planted link."""

import os

import pytest
import torch

import lcckpt
from lcckpt.format import stream
from lcckpt.interop.convert import convert

pytestmark = pytest.mark.skipif(os.name != "posix", reason="symbolic links and modes are POSIX")

SMALL = {"w": torch.arange(600, dtype=torch.float32).reshape(20, 30)}


def _writers(monkeypatch):
    """Each writer of a user-named file, by the name's suffix."""
    return {
        "small.lcc": lambda p, sd: lcckpt.save(sd, p),
        "streamed.lcc": lambda p, sd: (monkeypatch.setattr(stream, "STREAM_ABOVE", 0),
                                       lcckpt.save(sd, p), monkeypatch.undo()),
        "t.safetensors": lambda p, sd: lcckpt.save_safetensors(sd, p),
    }


@pytest.mark.parametrize("name", ["small.lcc", "streamed.lcc", "t.safetensors"])
def test_a_link_is_followed_and_kept(tmp_path, monkeypatch, name):
    write = _writers(monkeypatch)[name]
    (tmp_path / "disk").mkdir()
    real = tmp_path / "disk" / name
    write(str(real), {"w": torch.zeros(3)})
    os.chmod(real, 0o600)
    link = tmp_path / name
    link.symlink_to(real)
    write(str(link), SMALL)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert os.stat(real).st_mode & 0o777 == 0o600
    back = lcckpt.load_safetensors(real) if name.endswith(".safetensors") else lcckpt.load(real)
    assert torch.equal(back["w"], SMALL["w"])
    assert sorted(os.listdir(tmp_path)) == ["disk", name]      # no file beside the link
    assert sorted(os.listdir(tmp_path / "disk")) == [name]     # no temp file left


def test_a_dangling_link_makes_the_file_it_names(tmp_path):
    (tmp_path / "disk").mkdir()
    link = tmp_path / "ck.lcc"
    link.symlink_to(tmp_path / "disk" / "new.lcc")
    lcckpt.save(SMALL, link)
    assert link.is_symlink()
    assert torch.equal(lcckpt.load(tmp_path / "disk" / "new.lcc")["w"], SMALL["w"])


def test_a_link_to_a_device_is_refused(tmp_path):
    link = tmp_path / "ck.lcc"
    link.symlink_to("/dev/null")
    with pytest.raises(lcckpt.StorageError, match="character device"):
        lcckpt.save(SMALL, link)
    assert link.is_symlink()


def test_convert_to_torch_follows_the_link_and_keeps_the_mode(tmp_path):
    src = tmp_path / "in.lcc"
    lcckpt.save(SMALL, src)
    real = tmp_path / "real.pt"
    torch.save({}, real)
    os.chmod(real, 0o640)
    (tmp_path / "out.pt").symlink_to(real)
    convert(str(src), str(tmp_path / "out.pt"))
    assert (tmp_path / "out.pt").is_symlink()
    assert os.stat(real).st_mode & 0o777 == 0o640
    assert torch.equal(torch.load(real, weights_only=True)["w"], SMALL["w"])


def test_safetensors_overwrite_keeps_permissions(tmp_path):
    path = tmp_path / "t.safetensors"
    lcckpt.save_safetensors(SMALL, path)
    os.chmod(path, 0o604)
    lcckpt.save_safetensors(SMALL, path)
    assert os.stat(path).st_mode & 0o777 == 0o604


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another owner needs root")
def test_root_saving_over_a_users_file_keeps_its_owner(tmp_path):
    path = tmp_path / "ck.lcc"
    lcckpt.save(SMALL, path)
    os.chown(path, 4321, 4322)
    lcckpt.save(SMALL, path)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid) == (4321, 4322)


def test_a_chain_step_never_follows_a_planted_link(tmp_path):
    """A link planted at the next step's name must not redirect the writer to the file
    it names: the step replaces the link."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    chain = tmp_path / "chain"
    with lcckpt.DeltaCheckpointer(chain) as d:
        d.save(1, SMALL)
        (chain / "step-000000000002.lcc").symlink_to(victim)
        d.save(2, SMALL)
    assert victim.read_bytes() == b"keep me"
    assert not (chain / "step-000000000002.lcc").is_symlink()
    assert torch.equal(lcckpt.DeltaCheckpointer(chain).load(2)["w"], SMALL["w"])
