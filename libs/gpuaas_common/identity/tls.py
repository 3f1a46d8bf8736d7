"""A private CA and the certificates of our NATS listeners, made with `cryptography`.

The dev stack, the tests and compose's init step generate their own CA (`<dir>/ca.pem`); a real
deployment brings its own and only points the settings at it. Server certificates carry serverAuth
and clientAuth, because cluster routes verify both ways.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .creds import write_secret

VALIDITY = dt.timedelta(days=825)


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpuaas"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def make_ca_and_server_cert(
    out_dir: Path, hostnames: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",)
) -> TlsFiles:
    """Write `ca.pem`, `ca-key.pem`, `server.pem`, `server-key.pem` (keys 0600) and return their paths."""
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("gpuaas dev CA"))
        .issuer_name(_name("gpuaas dev CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(ca=out_dir / "ca.pem", cert=out_dir / "server.pem", key=out_dir / "server-key.pem")
    files.ca.write_text(ca.public_bytes(serialization.Encoding.PEM).decode())
    write_secret(out_dir / "ca-key.pem", _pem_key(ca_key))
    _write_server_cert(ca, ca_key, files, hostnames, ips)
    return files


def _write_server_cert(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    files: TlsFiles,
    hostnames: tuple[str, ...],
    ips: tuple[str, ...],
) -> None:
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in hostnames]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hostnames[0] if hostnames else "nats"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files.cert.write_text(cert.public_bytes(serialization.Encoding.PEM).decode())
    write_secret(files.key, _pem_key(key))


def issue_server_cert(
    ca_dir: Path,
    name: str,
    hostnames: tuple[str, ...] = ("localhost",),
    ips: tuple[str, ...] = ("127.0.0.1",),
    ca_key_file: Path | None = None,
) -> TlsFiles:
    """Another listener's certificate from the CA `make_ca_and_server_cert` wrote in `ca_dir` (the MAAS
    simulator's, say): `<name>.pem` and `<name>-key.pem` (0600) beside it, so one CA file pins every service.
    `ca_key_file`: where the CA's key is kept when not beside the CA (a deployment keeps it with the keys)."""
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    key_file = ca_key_file or ca_dir / "ca-key.pem"
    ca_key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_file} is not an EC key")
    files = TlsFiles(ca=ca_dir / "ca.pem", cert=ca_dir / f"{name}.pem", key=ca_dir / f"{name}-key.pem")
    _write_server_cert(ca, ca_key, files, hostnames, ips)
    return files


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """An HTTPS listener presenting `files.cert` (TLS 1.2 or newer)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(files.cert), str(files.key))
    return ctx


def client_context(ca_file: str | Path) -> ssl.SSLContext:
    """Verify the server against our CA only, never the system store: a NATS server is ours or nobody's."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_tls_options(ca_file: str | Path) -> dict[str, Any]:
    """nats.connect() options for our servers: our CA only, and TLS before the server's first line. The servers
    run `handshake_first`, and no first line a relay forges (one without `tls_required`) can keep us in plaintext."""
    return {"tls": client_context(ca_file), "tls_handshake_first": True}
