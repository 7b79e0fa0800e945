"""The Docker image the sandbox tests run in, built here without a registry.

The image is a small root filesystem copied from this (Debian) machine:
``/bin/sh``, coreutils, ps, grep, setsid and Debian's python3 with its
standard library, plus the shared libraries they load (found with ``ldd``).
It is packed into a tar and ``docker import``-ed under a fixed tag, once: a
later call, from this process or another, finds the tag and returns it.
"""

import fcntl
import functools
import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

IMAGE_REPOSITORY = "i3core-sandbox-test"
IMAGE_VERSION = "1"
"""Bump when the file list below changes, so a stale image on a machine is not reused."""
TAG = f"{IMAGE_REPOSITORY}:{IMAGE_VERSION}"

PYTHON = os.path.realpath("/usr/bin/python3")  # Debian's interpreter (python3.11 on bookworm), not a pyenv shim
PROGRAMS = ["/usr/bin/dash", "/usr/bin/ps", "/usr/bin/kill", "/usr/bin/grep", "/usr/bin/setsid",
            "/usr/bin/find", "/usr/bin/xargs", PYTHON]  # fmt: skip
LINKS = {"/usr/bin/sh": "dash", "/usr/bin/python3": os.path.basename(PYTHON), "/bin": "usr/bin",
         "/sbin": "usr/sbin", "/lib": "usr/lib", "/lib64": "usr/lib64"}  # fmt: skip
STDLIB = Path("/usr/lib") / os.path.basename(PYTHON)
STDLIB_SKIPPED = {"test", "dist-packages", "site-packages", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}
ETC = {
    "/etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "/etc/group": "root:x:0:\nnogroup:x:65534:\n",
}


def coreutils() -> list[str]:
    listing = subprocess.run(["dpkg", "-L", "coreutils"], capture_output=True, text=True, check=True).stdout
    return [p for p in listing.split() if "/bin/" in p and os.path.isfile(p)]


def shared_libraries(paths: list[str]) -> set[str]:
    """Every library the ELF files among ``paths`` load (``ldd``), as host paths."""
    libs: set[str] = set()
    for path in paths:
        result = subprocess.run(["ldd", path], capture_output=True, text=True, check=False)
        for line in result.stdout.splitlines():
            words = line.split()
            if "=>" in words and len(words) > words.index("=>") + 1 and words[words.index("=>") + 1].startswith("/"):
                libs.add(words[words.index("=>") + 1])
            elif words and words[0].startswith("/"):
                libs.add(words[0])  # the dynamic loader itself
    return libs


def _stdlib_files() -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(STDLIB):
        if dirpath == str(STDLIB):
            dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIPPED]
        files += [os.path.join(dirpath, f) for f in filenames]
    return files


def write_rootfs(out) -> None:
    """Write the image's root filesystem as a tar to the binary file ``out``."""
    programs = PROGRAMS + coreutils()
    stdlib = _stdlib_files()
    files = set(programs) | set(stdlib) | shared_libraries(programs + [f for f in stdlib if f.endswith(".so")])
    with tarfile.open(fileobj=out, mode="w") as tar:
        added: set[str] = set()

        def add_dir(path: str, mode: int = 0o755) -> None:
            if path in ("", "/") or path in added:
                return
            add_dir(os.path.dirname(path))
            info = tarfile.TarInfo(path.lstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
            added.add(path)

        for link, target in LINKS.items():
            info = tarfile.TarInfo(link.lstrip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
            added.add(link)
        for path in sorted(files):
            real = os.path.realpath(path)
            add_dir(os.path.dirname(real))
            if real not in added:
                tar.add(real, arcname=real.lstrip("/"), recursive=False)
                added.add(real)
            named = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
            if named != real and named not in added:  # e.g. ld-linux-x86-64.so.2 -> the loader's real file
                info = tarfile.TarInfo(named.lstrip("/"))
                info.type, info.linkname = tarfile.SYMTYPE, real
                tar.addfile(info)
                added.add(named)
        for path, text in ETC.items():
            add_dir(os.path.dirname(path))
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode = len(text), 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
        for path, mode in (("/tmp", 0o1777), ("/work", 0o755), ("/root", 0o700)):
            add_dir(path, mode)


@functools.cache
def test_image() -> str:
    """The tag of the sandbox test image, imported into the local engine on first use."""
    import docker
    from docker.errors import ImageNotFound

    client = docker.from_env(timeout=300)
    try:
        lock_path = Path(tempfile.gettempdir()) / f"{IMAGE_REPOSITORY}-{IMAGE_VERSION}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time across test processes
            try:
                client.images.get(TAG)
                return TAG
            except ImageNotFound:
                pass
            with tempfile.NamedTemporaryFile(suffix=".tar") as rootfs:
                write_rootfs(rootfs)
                rootfs.flush()
                client.api.import_image_from_file(rootfs.name, repository=IMAGE_REPOSITORY, tag=IMAGE_VERSION,
                                                  changes=["ENV PATH=/usr/local/bin:/usr/bin:/bin"])  # fmt: skip
            client.images.get(TAG)  # the import answers 200 even when it failed; make sure it is there
            return TAG
    finally:
        client.close()


test_image.__test__ = False  # a helper, not a test pytest should collect
