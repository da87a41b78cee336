"""TLS on every listener: the contexts, and a local CA for ``kera up --tls``.

A server started with ``--tls-cert``/``--tls-key`` speaks only TLS on its listener
(``kera.server``); with ``--tls-ca`` its own connections to other members check their
certificates against that CA, and a client that presents a certificate the CA signed is
taken as ``User:<its common name>`` (mTLS principals, with ``--auth``). Members still prove
the cluster secret inside TLS: TLS says the channel is private and the server is who it
claims, the secret says the peer is a member.

``local_ca`` makes what ``kera up --tls`` needs with the ``cryptography`` package: a CA and
one certificate for the servers of this machine (names ``localhost``, this host's name,
IP 127.0.0.1 and ::1), keys readable by their owner only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl


def server_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    ctx.num_tickets = 0   # no client resumes a session: a ticket would be work for nothing
    if ca:
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_OPTIONAL   # a client certificate names a principal if given
    return ctx


def client_context(ca: str | None) -> ssl.SSLContext:
    """How a member (or a client trusting ``ca``) opens TLS to a server."""
    return ssl.create_default_context(cafile=ca)


def add_arguments(ap) -> None:
    ap.add_argument("--tls-cert", default=None, metavar="PEM",
                    help="this server's certificate (chain): its listener then speaks TLS only")
    ap.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    ap.add_argument("--tls-ca", default=None, metavar="PEM",
                    help="the CA of the cluster's certificates: checks the servers this one "
                         "connects to, and client certificates (mTLS principals)")


def from_args(ap, args) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(the listener's context, the context this server connects to others with)."""
    if not args.tls_cert:
        if args.tls_key or args.tls_ca:
            ap.error("--tls-key and --tls-ca go with --tls-cert")
        return None, None
    try:
        return server_context(args.tls_cert, args.tls_key, args.tls_ca), client_context(args.tls_ca)
    except (OSError, ssl.SSLError) as e:
        ap.error(f"TLS: {e}")


def peer_principal(stream) -> str | None:
    """``User:<common name>`` of a verified client certificate, if one was presented."""
    cert = stream.getpeercert()
    for rdn in (cert or {}).get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return f"User:{v}"
    return None


def _write(path: str, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def local_ca(directory: str, addresses=()) -> dict[str, str]:
    """A CA and a server certificate for this machine in ``directory`` (kept if there), also
    naming ``addresses`` (host names or IPs the servers are reached at besides loopback):
    the paths of ``ca``, ``cert`` and ``key``."""
    paths = {k: os.path.join(directory, n) for k, n in
             (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"))}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(directory, mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kera local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=3650))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname()),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
    for a in sorted(set(addresses) - {"localhost", socket.gethostname(), "127.0.0.1", "::1"}):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(a)))
        except ValueError:
            names.append(x509.DNSName(a))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kera server")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=825))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    _write(paths["ca"], ca.public_bytes(pem), private=False)
    _write(paths["cert"], cert.public_bytes(pem), private=False)
    _write(paths["key"], key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), private=True)
    return paths   # the CA's key is not kept: nothing else is ever signed with it
