"""Real X.509 certificates for the TLS / mTLS tests: a CA, leaf certificates it signs, and a rogue CA."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Ca:
    def __init__(self, cn: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, cn: str, dns: list[str] = (), ips: list[str] = ()) -> tuple[bytes, bytes]:
        """A leaf certificate usable for server and client auth; returns (cert PEM, key PEM)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        if sans:  # a client certificate names no host; cryptography 51 refuses an empty SubjectAlternativeName
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = (builder
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def write_secret_dirs(root: Path, internal_name: str, api_keys: str) -> dict[str, Path]:
    """Lays out what the chart mounts under /etc/kimiserve: router-tls/, internal-tls/ and api-keys/, as Kubernetes
    Secrets would (tls.crt, tls.key, ca.crt). Returns the paths the tests need, plus a rogue client cert."""
    public_ca, internal_ca, rogue_ca = Ca("kimiserve test public CA"), Ca("kimiserve test internal CA"), Ca("rogue")
    out = {}
    for sub, ca, (cert, key) in (
            ("router-tls", public_ca, public_ca.issue("router", dns=["localhost"], ips=["127.0.0.1"])),
            ("internal-tls", internal_ca, internal_ca.issue(internal_name, dns=[internal_name])),
            ("rogue", rogue_ca, rogue_ca.issue(internal_name, dns=[internal_name]))):
        d = root / sub
        d.mkdir(parents=True)
        (d / "tls.crt").write_bytes(cert)
        (d / "tls.key").write_bytes(key)
        (d / "ca.crt").write_bytes(ca.pem)
        out[sub] = d
    (root / "api-keys").mkdir()
    (root / "api-keys" / "api-keys").write_text(api_keys)
    out["api-keys"] = root / "api-keys" / "api-keys"
    return out
