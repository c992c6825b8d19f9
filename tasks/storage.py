"""Filesystems for input and output URIs, with credentials resolved at the last moment.

Credentials live only in the filesystem objects built here: never in configs, plans, manifests,
metrics, logs or artifacts.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from schemas.run import StorageSpec


def _credentials(storage: StorageSpec) -> dict[str, str]:
    if storage.prefect_secret_block:
        from prefect.blocks.system import Secret

        value = Secret.load(storage.prefect_secret_block).get()
        if not isinstance(value, dict) or not {"key", "secret"} <= value.keys():
            raise ValueError(
                f"Prefect Secret block {storage.prefect_secret_block!r} must hold "
                '{"key": ..., "secret": ...}'
            )
        return {"key": value["key"], "secret": value["secret"]}
    found = {name: os.environ.get(var) for name, var in
             (("key", storage.key_env), ("secret", storage.secret_env))}
    return {name: value for name, value in found.items() if value}


def storage_options(uri: str, storage: StorageSpec) -> dict[str, Any]:
    """fsspec options for `uri`; empty for local paths."""
    if not uri.startswith("s3://"):
        return {}
    options: dict[str, Any] = _credentials(storage)
    if storage.endpoint_url:
        options["endpoint_url"] = storage.endpoint_url
    return options


def filesystem(uri: str, storage: StorageSpec, **extra: Any) -> tuple[AbstractFileSystem, str]:
    """The filesystem holding `uri` and the path inside it (no protocol); `extra`: more
    fsspec options (`corpusgen report --storage-option`)."""
    fs, path = fsspec.core.url_to_fs(uri, **storage_options(uri, storage), **extra)
    return fs, path.rstrip("/")


def is_local(fs: AbstractFileSystem) -> bool:
    return "file" in fs.protocol if isinstance(fs.protocol, tuple) else fs.protocol == "file"


CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId",
                     "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken")


def credentials_problem(
    error: BaseException, storage: StorageSpec, uris: tuple[str, ...]
) -> str | None:
    """One line saying which settings to fix when S3 has no credentials or refuses them; None
    for any other error, and for runs that touch no s3:// URI (a local PermissionError)."""
    if not any(uri.startswith("s3://") for uri in uris):
        return None
    text = f"{type(error).__name__}: {error}"
    if not isinstance(error, PermissionError) and not any(n in text for n in CREDENTIAL_ERRORS):
        return None
    where = (f"the Prefect Secret block {storage.prefect_secret_block!r}"
             if storage.prefect_secret_block else f"{storage.key_env} and {storage.secret_env}")
    endpoint = storage.endpoint_url or "AWS's default endpoint"
    return (
        f"S3 credentials missing or refused ({text.splitlines()[0]}): set {where} (or "
        f"storage.key_env / storage.secret_env / storage.prefect_secret_block in the config) "
        f"to a key that may read the input and write the output at {endpoint}"
    )
