"""Throwaway certificate authorities for the mutual-TLS tests, made with the `openssl` command line
(the `cryptography` package is not a dependency)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """(ca.pem, ca.key) of a new CA named `name`."""
    directory.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
         f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_cert(directory: Path, ca: tuple[Path, Path], name: str) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for 127.0.0.1 / localhost, good for serving and for client auth."""
    (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                           "extendedKeyUsage=serverAuth,clientAuth\n")
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
         "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
         "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"
