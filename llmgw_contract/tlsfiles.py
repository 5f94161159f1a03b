"""Building an `ssl.SSLContext` from PEM files named by settings, with errors that name
the setting: the one place planner and router do it (their settings call
:func:`tls_context` when they are validated, so a bad file is an exit 2 at start, not a
failure at the first request).
"""

from __future__ import annotations

import ssl


def tls_context(
    names: tuple[str, str, str],
    cafile: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    *,
    server: bool = False,
) -> ssl.SSLContext:
    """An SSLContext from PEM files: as a client (`server=False`) it verifies the peer
    with `cafile` (else the system's CAs) and presents `certfile`/`keyfile` when given;
    as a server it presents them. `names` name the three settings in errors.

    Raises ValueError naming the setting when a file cannot be read or parsed, when a
    certificate or key is given without the other, or when the key does not match."""
    ca_name, cert_name, key_name = names
    if bool(certfile) != bool(keyfile):
        given, missing = (cert_name, key_name) if certfile else (key_name, cert_name)
        raise ValueError(
            f"{given} is set but {missing} is not: a certificate and its key go together"
        )
    for name, path in ((ca_name, cafile), (cert_name, certfile), (key_name, keyfile)):
        if path:
            _readable(name, path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER) if server else ssl.create_default_context()
    if cafile:
        try:
            context.load_verify_locations(cafile=cafile)
        except ssl.SSLError as exc:
            raise ValueError(
                f"{ca_name}={cafile}: not a PEM CA certificate ({exc.reason or exc})"
            ) from None
    if certfile and keyfile:
        try:
            context.load_cert_chain(certfile, keyfile)
        except ssl.SSLError as exc:
            raise ValueError(
                f"{cert_name}={certfile} and {key_name}={keyfile} do not load as "
                f"a PEM certificate and its key ({exc.reason or exc})"
            ) from None
    return context


def _readable(name: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"{name}={path}: {exc.strerror or exc}") from None
