"""Values exchanged between ranks without pickle.

torch's object collectives (the ``*_object`` and ``*_object_list`` functions) pickle
what is sent and unpickle what is received, so whoever takes a seat in a round (its
TCPStore is reachable by other users of the cluster) could run code in every receiver.
Every object slurm_elastic exchanges goes through this module instead:

* values are encoded as the checkpoint container encodes a state (a JSON tree of
  tensors, containers and plain values: :func:`~slurm_elastic.checkpoint.container.encode_tree`);
  tensors travel as raw bytes, described by records that are parsed strictly (dtypes the
  writer emits, integer shapes, aligned non-overlapping offsets);
* sizes are announced first and checked against a limit before anything is allocated;
* :func:`broadcast` lets each receiver inspect the announced structure (a ``check``
  callback sees :class:`TensorSpec` in place of each tensor) and all ranks vote before any
  tensor byte is sent: a refused value raises :class:`~slurm_elastic.errors.StateExchangeError`
  on every rank, nothing of the receiver's replaced, nobody left waiting in a collective.

Collectives run on the group's device (CPU for gloo, the current CUDA device for NCCL).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slurm_elastic.checkpoint.container import (
    check_records,
    decode_tree,
    encode_tree,
)
from slurm_elastic.errors import CheckpointCorruptError, StateExchangeError, UnsupportedStateError
from slurm_elastic.training.state import TensorSpec

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_HEADER",
    "TensorSpec",
    "all_gather",
    "broadcast",
    "broadcast_int",
    "decode",
    "encode",
    "pack",
    "unpack",
]

DEFAULT_LIMIT = 1 << 20
"""Default bound on a small value's encoded size (1 MiB): steps, messages, RNG states."""

MAX_HEADER = 64 << 20
"""The most bytes a received value's JSON header may have."""
_ALIGN = 64
_BLOB = struct.Struct("<8sQQ")
_BLOB_MAGIC = b"SLEWIRE1"


def _device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def encode(value: Any) -> tuple[bytes, torch.Tensor]:
    """``(header, data)``: ``value`` as a JSON header and one CPU uint8 tensor holding
    every tensor's bytes back to back (no pickle; one copy of the tensors);
    :func:`decode` reverses it.

    Raises:
        StateExchangeError: ``value`` holds something this encoding does not carry.
    """
    try:
        tree, records, tensors = encode_tree(value)
    except UnsupportedStateError as exc:
        raise StateExchangeError(f"cannot send this value without pickle: {exc}") from exc
    size = max((r["offset"] + r["nbytes"] for r in records), default=0)
    data = torch.empty(size, dtype=torch.uint8)
    for rec, raw in zip(records, tensors, strict=True):
        data[rec["offset"] : rec["offset"] + rec["nbytes"]] = raw
    header = json.dumps({"tree": tree, "tensors": records}, separators=(",", ":")).encode()
    return header, data


def _parse_header(header: bytes, data_size: int) -> tuple[Any, list[Any]]:
    try:
        body = json.loads(header)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"header is not JSON ({exc})") from exc
    if type(body) is not dict or set(body) != {"tree", "tensors"}:
        raise CheckpointCorruptError("header is not a value description")
    records = check_records(body["tensors"], data_size)
    extent = max((r.offset + r.nbytes for r in records), default=0)
    if extent != data_size:  # the sender packs the tensors back to back, nothing more
        raise CheckpointCorruptError(f"{data_size} data bytes announced, the tensors take {extent}")
    return body["tree"], records


def _specs(tree: Any, records: list[Any]) -> Any:
    return decode_tree(tree, [TensorSpec(r.dtype, tuple(r.shape)) for r in records])


def _materialize(tree: Any, records: list[Any], data: torch.Tensor) -> Any:
    tensors = []
    for r in records:
        if r.nbytes == 0:
            tensors.append(torch.empty(r.shape, dtype=r.dtype, device=data.device))
        else:
            raw = data[r.offset : r.offset + r.nbytes]
            tensors.append(raw.view(r.dtype).view(r.shape))
    return decode_tree(tree, tensors)


def decode(header: bytes, data: torch.Tensor, *, check: Callable[[Any], None] | None = None) -> Any:
    """What :func:`encode` encoded; the tensors are views of ``data`` (a uint8 tensor).
    ``check`` sees the structure (:class:`TensorSpec` in place of each tensor) first.

    Raises:
        StateExchangeError: malformed (records out of ``data``, overlapping, ...).
        Exception: whatever ``check`` raises.
    """
    if len(header) > MAX_HEADER:
        raise StateExchangeError(f"received a header of {len(header)} bytes")
    try:
        tree, records = _parse_header(header, data.numel())
    except CheckpointCorruptError as exc:
        raise StateExchangeError(f"received a malformed value: {exc}") from exc
    if check is not None:
        check(_specs(tree, records))
    return _materialize(tree, records, data)


def pack(value: Any) -> bytes:
    """Encode ``value`` (tensors, containers, plain values) as bytes, no pickle.

    Raises:
        StateExchangeError: ``value`` holds something this encoding does not carry.
    """
    header, data = encode(value)
    start = _BLOB.size + len(header)
    pad = -start % _ALIGN
    return (
        _BLOB.pack(_BLOB_MAGIC, len(header), data.numel())
        + header
        + bytes(pad)
        + data.numpy().tobytes()
    )


def unpack(
    blob: bytes | bytearray | memoryview | torch.Tensor, *, limit: int = DEFAULT_LIMIT
) -> Any:
    """Decode what :func:`pack` encoded; tensors are CPU tensors of their own.

    Raises:
        StateExchangeError: malformed, or larger than ``limit`` bytes.
    """
    raw = blob.cpu().numpy().tobytes() if isinstance(blob, torch.Tensor) else bytes(blob)
    if len(raw) > limit:
        raise StateExchangeError(f"received value of {len(raw)} bytes; at most {limit} allowed")
    try:
        if len(raw) < _BLOB.size:
            raise CheckpointCorruptError("too short")
        magic, hlen, dlen = _BLOB.unpack_from(raw)
        if magic != _BLOB_MAGIC:
            raise CheckpointCorruptError(f"bad magic {magic!r}")
        start = _BLOB.size + hlen
        start += -start % _ALIGN
        if start + dlen != len(raw):
            raise CheckpointCorruptError(f"sizes {hlen}+{dlen} do not add up to {len(raw)}")
        tree, records = _parse_header(raw[_BLOB.size : _BLOB.size + hlen], dlen)
        data = (
            torch.frombuffer(bytearray(raw[start:]), dtype=torch.uint8)
            if dlen
            else torch.empty(0, dtype=torch.uint8)
        )
        return _materialize(tree, records, data)
    except CheckpointCorruptError as exc:
        raise StateExchangeError(f"received a malformed value: {exc}") from exc


def _vote(failed: bool, group: Any, device: torch.device) -> int:
    """Collective: the lowest rank that failed, or -1 if none did."""
    world = dist.get_world_size(group)
    flag = torch.tensor(
        [dist.get_rank(group) if failed else world], dtype=torch.int64, device=device
    )
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    lowest = int(flag.item())
    return -1 if lowest >= world else lowest


def _refused(local: BaseException | None, who: int, what: str) -> StateExchangeError:
    if local is not None:
        return local if isinstance(local, StateExchangeError) else StateExchangeError(str(local))
    return StateExchangeError(f"{what} was refused by rank {who}; nothing was replaced")


def broadcast(
    value: Any,
    src: int,
    *,
    group: Any = None,
    check: Callable[[Any], None] | None = None,
    limit: int = DEFAULT_LIMIT,
    to_cpu: bool = True,
) -> Any:
    """Collective: every rank gets ``value`` of rank ``src`` (others pass ``None``).

    Args:
        value: on ``src``, tensors, containers and plain values (no other objects).
        src: the sending rank (in ``group``).
        group: the process group (default: the world).
        check: called on each receiver with the announced value (a :class:`TensorSpec` in
            place of each tensor) before any tensor byte is sent; raise to refuse it.
        limit: the most bytes (header and tensor data each) a receiver accepts.
        to_cpu: receivers get CPU tensors (else on the group's device).

    Returns:
        ``value`` on ``src``; the received value elsewhere.

    Raises:
        StateExchangeError: on every rank, if any receiver refused the value (malformed,
            over ``limit``, or ``check`` raised): nothing was received.
    """
    me = dist.get_rank(group)
    ex = _Exchange(group, _device(group), src, me, f"the value from rank {src}")
    header = b""
    data: torch.Tensor | None = None
    local: StateExchangeError | None = None
    if ex.sending:
        try:
            header, data = encode(value)
        except StateExchangeError as exc:
            local = exc
    ex.agree(local)  # the sender's own refusal first
    hlen, dlen = _broadcast_sizes(ex, header, data, limit)
    tree, records = _broadcast_header(ex, header, hlen, dlen, check)
    if ex.sending:
        if data is None:  # an internal invariant: the sender's own refusal raised above
            raise StateExchangeError(f"{ex.what} has no data to send")
        if dlen:
            dist.broadcast(data.to(ex.device), src=src, group=group)
        return value
    received = torch.empty(dlen, dtype=torch.uint8, device=ex.device)
    if dlen:
        dist.broadcast(received, src=src, group=group)
    if to_cpu:
        received = received.cpu()
    try:
        return _materialize(tree, records, received)
    except CheckpointCorruptError as exc:  # checked above; kept for a clear error
        raise StateExchangeError(f"{ex.what} is malformed: {exc}") from exc


@dataclass(frozen=True)
class _Exchange:
    """One :func:`broadcast`'s parties: the group, its device, the sender and this rank."""

    group: Any
    device: torch.device
    src: int
    me: int
    what: str  # how messages name the value

    @property
    def sending(self) -> bool:
        return self.me == self.src

    def agree(self, local: BaseException | None) -> None:
        """Collective: raise on every rank if any rank refused (``local``: this one's
        refusal), so that every rank leaves the exchange at the same point."""
        failed = _vote(local is not None, self.group, self.device)
        if failed >= 0:
            raise _refused(local, failed, self.what)


def _broadcast_sizes(
    ex: _Exchange, header: bytes, data: torch.Tensor | None, limit: int
) -> tuple[int, int]:
    """Collective: the header and data sizes the sender announces, checked by every
    receiver against ``limit`` before anything is allocated."""
    if ex.sending:
        sizes = torch.tensor(
            [len(header), data.numel() if data is not None else 0],
            dtype=torch.int64,
            device=ex.device,
        )
    else:
        sizes = torch.zeros(2, dtype=torch.int64, device=ex.device)
    dist.broadcast(sizes, src=ex.src, group=ex.group)
    hlen, dlen = (int(v) for v in sizes.tolist())
    local = None
    if not ex.sending and not (0 < hlen <= min(MAX_HEADER, limit) and 0 <= dlen <= limit):
        local = StateExchangeError(
            f"{ex.what} announces {hlen} header and {dlen} data bytes; at most {limit} allowed"
        )
    ex.agree(local)
    return hlen, dlen


def _broadcast_header(
    ex: _Exchange, header: bytes, hlen: int, dlen: int, check: Callable[[Any], None] | None
) -> tuple[Any, list[Any]]:
    """Collective: the header (the value's structure), parsed and checked by every
    receiver before any tensor byte is sent; ``(tree, records)`` (empty on the sender)."""
    hbuf = torch.zeros(hlen, dtype=torch.uint8, device=ex.device)
    if ex.sending:
        hbuf.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    dist.broadcast(hbuf, src=ex.src, group=ex.group)
    tree: Any = None
    records: list[Any] = []
    local: BaseException | None = None
    if not ex.sending:
        try:
            tree, records = _parse_header(hbuf.cpu().numpy().tobytes(), dlen)
            if check is not None:
                check(_specs(tree, records))
        except CheckpointCorruptError as exc:
            local = StateExchangeError(f"{ex.what} is malformed: {exc}")
        except Exception as exc:  # the check's refusal, whatever its type
            local = exc
    ex.agree(local)
    return tree, records


def broadcast_int(value: int | None, src: int = 0, *, group: Any = None) -> int | None:
    """Collective: rank ``src``'s integer (or ``None``) on every rank; one tensor, no
    encoding (values must fit in int64 and not be ``-2**63``, which stands for ``None``)."""
    none = -(1 << 63)
    t = torch.tensor(
        [none if value is None else int(value)], dtype=torch.int64, device=_device(group)
    )
    dist.broadcast(t, src=src, group=group)
    got = int(t.item())
    return None if got == none else got


def all_gather(value: Any, *, group: Any = None, limit: int = DEFAULT_LIMIT) -> list[Any]:
    """Collective: every rank's ``value`` (small: at most ``limit`` bytes each), in rank order.

    Every rank sees the same bytes, so a malformed or oversized contribution is refused
    by every rank alike (no vote needed).

    Raises:
        StateExchangeError: on every rank, if a contribution is malformed or too large
            (the message names the rank).
    """
    device = _device(group)
    world = dist.get_world_size(group)
    try:
        mine = pack(value)
        error = None
    except StateExchangeError as exc:
        mine, error = b"", exc
    size = torch.tensor([len(mine) if error is None else -1], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    bad = [r for r, n in enumerate(lengths) if not 0 <= n <= limit]
    if bad:
        if error is not None:
            raise error
        raise StateExchangeError(
            f"rank {bad[0]} sent {lengths[bad[0]]} bytes to an all-gather; at most {limit} allowed"
        )
    longest = max(lengths)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else buf[:0]
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    out = []
    for rank, (blob, n) in enumerate(zip(bufs, lengths, strict=True)):
        try:
            out.append(unpack(blob[:n], limit=limit))
        except StateExchangeError as exc:
            raise StateExchangeError(f"rank {rank}'s contribution: {exc}") from exc
    return out
