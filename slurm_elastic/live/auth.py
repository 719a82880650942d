"""The round's store, sealed with the run's key: only the run's own processes take a seat.

A round's TCPStore is reachable by anyone on the cluster network, and TCPStore has no
authentication (any client may ``set``, ``get`` and even ``list_keys``). Before this, a
process of another user could find a pending round in the store, write its own address
as rank 0's before the real rank 0, and become the newcomers' rank 0.

Here every value the workers put in the store (their ``ready/<rank>`` marks and the whole
process-group namespace: gloo's addresses, NCCL's unique id) is **sealed**: encrypted and
authenticated with a key only the run's processes can read.

* The run key: 32 random bytes in a ``0600`` file inside the run's private directory
  (created once, ``O_EXCL``, by the first agent; :func:`load_or_create_key`); the
  workers get its path in ``SLURM_ELASTIC_KEY_FILE``. Who cannot read the run's
  directory cannot read the key.
* A round key per round: ``HMAC-SHA256(run key, "slurm_elastic round <n>")``, so a value
  of one round is worthless in another.
* A sealed value: ``nonce(16) || ciphertext || tag(32)``; the ciphertext is the value
  XOR an HMAC-SHA256 keystream (counter mode over the nonce), the tag an HMAC-SHA256 over
  the store key, the nonce and the ciphertext (encrypt-then-MAC; separate encryption and
  MAC keys derived from the round key). A value moved to another key, altered,
  truncated or made up fails its tag.

:class:`SealedStore` wraps the round's store: ``set`` seals, ``get`` returns only a
value that opens and otherwise keeps waiting for one until its timeout (an outsider who
writes first is skipped; one who overwrites a real value can only make the round time
out: denial of service, the documented limit). Counters (``add``) are not sealed; gloo
and NCCL's set-up use only ``set``/``get``/``wait``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import stat
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from slurm_elastic.envvars import KEY_FILE_ENV
from slurm_elastic.errors import RoundSupersededError, StoreUnansweredError, UnsafeDirectoryError
from slurm_elastic.privatefs import READ_FLAGS, SafeDir, publish_exclusive
from slurm_elastic.rendezvous.bounded_call import call_bounded

__all__ = [
    "KEY_BYTES",
    "KEY_FILE_ENV",
    "SealedStore",
    "load_key",
    "load_or_create_key",
    "round_key",
    "seal",
    "unseal",
    "worker_key",
]

log = logging.getLogger(__name__)

KEY_BYTES = 32
_NONCE = 16
_TAG = 32
_POLL_S = 0.05
#: A wait of a store with ``abandon`` looks at it this often.
WAIT_SLICE_S = 0.5


# ---------------------------------------------------------------------------- the key


def _check_key_file(fd: int, where: str) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(f"run key {where} is not a regular file of yours")
    if st.st_mode & 0o077:
        raise UnsafeDirectoryError(
            f"run key {where} has mode {stat.filemode(st.st_mode)}: others may read it. "
            f"Remove it (a new one is made at the next start): rm {where}"
        )
    data = os.read(fd, KEY_BYTES + 1)
    if len(data) != KEY_BYTES:
        raise UnsafeDirectoryError(
            f"run key {where} holds {len(data)} bytes, not {KEY_BYTES}: damaged. Remove it "
            f"when no agent of the run is running: rm {where}"
        )
    return data


def load_key(path: str | os.PathLike[str]) -> bytes:
    """Read a run key (a ``0600`` regular file of this user, exactly 32 bytes, no link).

    Raises:
        UnsafeDirectoryError: not ours, readable by others, a link, or damaged.
        OSError: it cannot be read.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeDirectoryError(f"run key {path} is a symbolic link; refusing it") from exc
        raise
    try:
        return _check_key_file(fd, str(path))
    finally:
        os.close(fd)


def load_or_create_key(directory: str | os.PathLike[str], name: str) -> Path:
    """The run key file ``directory/name``, created with 32 random bytes if missing.

    ``directory`` must be a private directory of this user (see
    :func:`slurm_elastic.privatefs.ensure_private_dir`); agents of several nodes may call
    this at once: the first complete file wins (written aside, then linked into place).

    Returns:
        The key file's path (for ``SLURM_ELASTIC_KEY_FILE``).

    Raises:
        UnsafeDirectoryError: the directory or the file is not private.
    """
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a file name")
    path = Path(directory) / name
    with SafeDir.open_checked(directory, follow=False) as held:  # ours, private, no link
        dfd = held.fd
        for _ in range(2):
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                # Written aside, then linked into place: the first complete key wins;
                # another agent's that won is read on the next pass.
                publish_exclusive(name, os.urandom(KEY_BYTES), dir_fd=dfd, fsync=True)
                continue
            try:
                _check_key_file(fd, str(path))
            finally:
                os.close(fd)
            return path
        raise UnsafeDirectoryError(f"run key {path} vanished while being created; retry")


def round_key(run_key: bytes, round_: int) -> bytes:
    """The key of round ``round_`` (values of one round do not open in another)."""
    return hmac.new(run_key, f"slurm_elastic round {int(round_)}".encode(), hashlib.sha256).digest()


# ---------------------------------------------------------------------------- sealing


def _subkeys(key: bytes) -> tuple[bytes, bytes]:
    return (
        hmac.new(key, b"encrypt", hashlib.sha256).digest(),
        hmac.new(key, b"authenticate", hashlib.sha256).digest(),
    )


def _keystream(key: bytes, nonce: bytes, n: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hmac.new(key, nonce + counter.to_bytes(8, "big"), hashlib.sha256).digest()
        counter += 1
    return bytes(out[:n])


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _tag(key: bytes, name: str, nonce: bytes, body: bytes) -> bytes:
    label = name.encode()
    msg = len(label).to_bytes(4, "big") + label + nonce + body
    return hmac.new(key, msg, hashlib.sha256).digest()


def seal(key: bytes, name: str, value: bytes) -> bytes:
    """``value`` encrypted and authenticated for store key ``name``."""
    enc, mac = _subkeys(key)
    nonce = os.urandom(_NONCE)
    body = _xor(value, _keystream(enc, nonce, len(value))) if value else b""
    return nonce + body + _tag(mac, name, nonce, body)


def unseal(key: bytes, name: str, sealed: bytes) -> bytes | None:
    """The value sealed for ``name`` with ``key``; ``None`` if it does not open."""
    if len(sealed) < _NONCE + _TAG:
        return None
    enc, mac = _subkeys(key)
    nonce, body, tag = sealed[:_NONCE], sealed[_NONCE:-_TAG], sealed[-_TAG:]
    if not hmac.compare_digest(tag, _tag(mac, name, nonce, body)):
        return None
    return _xor(body, _keystream(enc, nonce, len(body))) if body else b""


class SealedStore(dist.Store):
    """A store whose values are sealed with a round key (see the module docstring).

    Args:
        inner: the round's store (e.g. a ``PrefixStore`` over its ``TCPStore``).
        key: the round key (:func:`round_key`).
        timeout: how long :meth:`get` waits for a value that opens.
        abandon: asked between slices of a wait (:data:`WAIT_SLICE_S`); a reason it
            returns ends the wait with :class:`~slurm_elastic.errors.RoundSupersededError`
            (the round's group is forming and a newer round is assigned: the peers it
            waits for have gone on). ``None``: waits run their whole timeout.

    With ``abandon``, every call that waits for the store's answer (``get``, ``wait``,
    ``check``) runs on a helper thread (:func:`~slurm_elastic.rendezvous.bounded_call.
    call_bounded`): a frozen host accepts requests and never answers them, and torch's
    client then waits with no timeout, inside ``init_process_group`` too; ``abandon``
    ends that wait as well.
    """

    def __init__(
        self,
        inner: Any,
        key: bytes,
        timeout: timedelta,
        abandon: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._key = key
        self._timeout = timeout
        self._abandon = abandon
        self._warned: set[str] = set()

    def _answer(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the inner store; abandoned as the round is (see the class)."""
        abandon = self._abandon
        if abandon is None:
            return call()
        try:
            return call_bounded(
                call,
                limit_s=self._timeout.total_seconds() + WAIT_SLICE_S,
                give_up=abandon,
                slice_s=WAIT_SLICE_S,
            )
        except StoreUnansweredError as exc:
            raise RoundSupersededError(f"{exc} (this round's store): giving it up") from None

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, seal(self._key, key, data))

    def opened(self, key: str) -> bytes | None:
        """The value at ``key`` if it is there and opens; never waits."""
        if not self._answer(lambda: self._inner.check([key])):
            return None
        value = unseal(self._key, key, self._answer(lambda: self._inner.get(key)))
        if value is None:
            self._warn(key)
        return value

    def get(self, key: str) -> bytes:
        if self._abandon is not None:
            self.wait([key])  # the inner get would block the whole timeout
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            value = unseal(self._key, key, self._answer(lambda: self._inner.get(key)))
            if value is not None:
                return value
            self._warn(key)
            if time.monotonic() >= deadline:
                # torch's own type for a store wait that timed out (a subclass of
                # RuntimeError), so the loop treats it as any store timeout: a peer lost
                raise dist.DistStoreError(
                    f"the round's store holds no value at {key!r} sealed with this run's key "
                    f"within {self._timeout.total_seconds():.0f} s: another user writes into "
                    "the store (denial of service), or the nodes do not share the run's key "
                    "(the rendezvous/state directory must be on a filesystem all nodes share)"
                )
            time.sleep(_POLL_S)

    def _warn(self, key: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "the round's store holds a value at %r not sealed with this run's key: "
                "ignored (another process writes into the store)",
                key,
            )

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if self._abandon is None:
            if timeout is None:
                self._inner.wait(keys)
            else:
                self._inner.wait(keys, timeout)
            return
        deadline = time.monotonic() + (timeout or self._timeout).total_seconds()
        while True:
            part = max(0.001, min(WAIT_SLICE_S, deadline - time.monotonic()))
            try:
                self._answer(lambda: self._inner.wait(keys, timedelta(seconds=part)))  # noqa: B023
                return
            except dist.DistStoreError:  # this slice timed out
                if time.monotonic() >= deadline:
                    raise
                reason = self._abandon()
                if reason is not None:
                    raise RoundSupersededError(
                        f"{reason} while this round's group forms: giving up the wait"
                    ) from None

    def check(self, keys: list[str]) -> bool:
        return bool(self._answer(lambda: self._inner.check(keys)))

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        raise NotImplementedError("compare_set on a sealed store (values are never equal)")

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._inner.set_timeout(timeout)


def worker_key() -> bytes | None:
    """The run key named by ``SLURM_ELASTIC_KEY_FILE``, or ``None`` when it is unset.

    Raises:
        UnsafeDirectoryError: the file is not private or is damaged.
    """
    path = os.environ.get(KEY_FILE_ENV)
    return load_key(path) if path else None
