"""Our tensor container format (``state.bin``): a JSON header, then raw tensor bytes.

No pickle anywhere: a checkpoint in this format can hold tensors, containers and plain
values, nothing that could run code when read. Layout::

    0   8 bytes   magic b"SLECKPT1"
    8   8 bytes   header length H (little-endian unsigned)
    16  H bytes   header: UTF-8 JSON {"tree": ..., "tensors": [...], "data_start": D}
    ..  zeros     up to D (a multiple of 4096)
    D   ...       tensor bytes; tensor i at D + tensors[i]["offset"] (64-byte aligned),
                  C-contiguous, little-endian as in memory

The tree is JSON in which a plain list is a ``list`` and every other container is a tagged
one-key object, so no two Python values share an encoding (``1`` vs ``"1"`` keys, tuples vs
lists, dicts with non-``str`` keys)::

    {"T": i}  tensor i          {"t": [...]}  tuple       {"d": [[k, v], ...]}  dict
    {"o": [[k, v], ...]}  OrderedDict                      {"S": [...]}  torch.Size
    {"b": "<base64>"}  bytes    {"c": [re, im]}  complex   {"y": "float32"}  torch.dtype
    {"v": "cuda:0"}  torch.device

``None``, ``bool``, ``int``, ``float`` (NaN/inf included) and ``str`` are themselves.
Anything else raises :class:`~slurm_elastic.errors.UnsupportedStateError`. Tensors that are
the same view of the same memory are stored once (tied weights stay tied); other storage
sharing is not preserved (each view is stored contiguous).

Writing: the segments (header, padding, each tensor's memory as it is, no copy) go out
with ``os.writev`` in 16 MiB pieces, each CRCed just before it is written (ISA-L's CRC32
releases the GIL); the commit fsyncs. Reading: the whole file is read into one buffer
(huge pages) or mapped, each chunk CRCed as it arrives while the kernel reads ahead; only
when the CRC and size match the manifest record is the header parsed; every tensor then
has its own storage inside that buffer (no copy), which the buffer outlives.

Damage vs environment: only this format's evidence (size, CRC32, a header or tree this
writer never produces) is ``CheckpointCorruptError``; an I/O or memory error is
``CheckpointReadError`` (the file stays). The reader returns CPU tensors (placing them is
the serializer's job; a device missing on this node is not damage either).
"""

from __future__ import annotations

import base64
import ctypes
import itertools
import json
import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

import torch

from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.manifest import crc32, crc32_mapping
from slurm_elastic.checkpoint.trust import CheckpointDir, open_data_file, read_error
from slurm_elastic.errors import CheckpointCorruptError, UnsupportedStateError
from slurm_elastic.privatefs import create_new

__all__ = [
    "DTYPES",
    "MAGIC",
    "Parsed",
    "Unsupported",
    "UnsupportedStateError",
    "check_encodable",
    "check_records",
    "decode_tree",
    "encode",
    "encode_tree",
    "read_container",
    "write_container",
]

MAGIC = b"SLECKPT1"
_PREFIX = struct.Struct("<8sQ")
_PAGE = 4096
_ALIGN = 64
_BATCH_BYTES = 16 << 20  # per write call (and the granularity of the mid-write hook)
_IOV_MAX = 512
_READ_CHUNK = 64 << 20  # per read (measured: 64 MiB reads beat 4 and 16 MiB here)
_MAX_HEADER = 1 << 30

# Exactly the dtypes the writer emits and the reader accepts: plain numbers whose bytes are
# the value. Quantized dtypes (a tensor needs a quantizer: one made from bytes alone crashes
# on use) and bit/packed dtypes are not stored (the serializer falls back to torch.save).
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)
}
_NAME_OF_DTYPE = {d: n for n, d in DTYPES.items()}
# Devices a record may name (where the tensor was saved from; the reader maps it).
_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "privateuseone"})
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


#: The former name of :class:`~slurm_elastic.errors.UnsupportedStateError`.
Unsupported = UnsupportedStateError


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _Encoder:
    def __init__(self, *, check_only: bool = False) -> None:
        self.check_only = check_only  # refuse what is not storable; read no tensor byte
        self.tensors: list[torch.Tensor] = []  # flat uint8 views of the data
        self.records: list[dict[str, Any]] = []
        self._ids: dict[tuple[Any, ...], int] = {}
        self.offset = 0

    def tensor(self, t: torch.Tensor, where: str) -> int:
        if type(t) not in _PLAIN_TENSOR_TYPES or t.layout != torch.strided:
            raise UnsupportedStateError(f"{where}: a {type(t).__name__} with layout {t.layout}")
        if t.is_quantized or t.dtype not in _NAME_OF_DTYPE or t.device.type not in _DEVICE_TYPES:
            raise UnsupportedStateError(f"{where}: a tensor of dtype {t.dtype} on {t.device}")
        if self.check_only:
            return -1
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.data_ptr() != 0 and key in self._ids:
            return self._ids[key]
        device = str(t.device)
        data = t.detach()
        if data.is_conj() or data.is_neg():
            data = data.resolve_conj().resolve_neg()
        if data.device.type != "cpu":
            data = data.cpu()
        if not data.is_contiguous():
            data = data.contiguous()
        nbytes = data.numel() * data.element_size()
        try:
            raw = data.reshape(-1).view(torch.uint8)
        except RuntimeError as exc:
            raise UnsupportedStateError(f"{where}: a tensor of dtype {t.dtype} ({exc})") from exc
        self.offset = _align(self.offset, _ALIGN)
        self.records.append(
            {
                "dtype": _NAME_OF_DTYPE[data.dtype],
                "shape": list(data.shape),
                "offset": self.offset,
                "nbytes": nbytes,
                "device": device,
            }
        )
        self.tensors.append(raw)
        self.offset += nbytes
        index = len(self.records) - 1
        if t.data_ptr() != 0:
            self._ids[key] = index
        return index

    def tree(self, obj: Any, where: str) -> Any:
        kind = type(obj)
        if obj is None or kind in (bool, int, str, float):
            return obj
        if isinstance(obj, torch.Tensor):
            return {"T": self.tensor(obj, where)}
        if kind is list:
            return [self.tree(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if kind is tuple:
            return {"t": [self.tree(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
        if kind is dict or kind is OrderedDict:
            items = [
                [self.tree(k, f"{where} key"), self.tree(v, f"{where}[{k!r}]")]
                for k, v in obj.items()
            ]
            return {"d" if kind is dict else "o": items}
        if kind is torch.Size:
            return {"S": list(obj)}
        if kind is bytes:
            return {"b": base64.b64encode(obj).decode()}
        if kind is complex:
            return {"c": [obj.real, obj.imag]}
        if kind is torch.dtype:
            if obj not in _NAME_OF_DTYPE:
                raise UnsupportedStateError(f"{where}: the dtype {obj}")
            return {"y": _NAME_OF_DTYPE[obj]}
        if kind is torch.device:
            return {"v": str(obj)}
        raise UnsupportedStateError(f"{where}: a {kind.__module__}.{kind.__qualname__}")


def encode_tree(state: Any) -> tuple[Any, list[dict[str, Any]], list[torch.Tensor]]:
    """Return ``(tree, records, data)``: the JSON tree of ``state`` (tensors as
    ``{"T": i}``), one record per tensor (``dtype``, ``shape``, ``offset``, ``nbytes``,
    ``device``; offsets packed from 0, 64-byte aligned) and each tensor's bytes as a flat
    ``uint8`` CPU tensor.

    Raises:
        UnsupportedStateError: ``state`` holds a value this format does not store.
    """
    enc = _Encoder()
    tree = enc.tree(state, "state")
    return tree, enc.records, enc.tensors


def check_encodable(state: Any) -> None:
    """Raise :class:`UnsupportedStateError` where :func:`encode` would (reads no data)."""
    _Encoder(check_only=True).tree(state, "state")


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Return the file's leading bytes (prefix, header, padding) and the tensor bytes
    after them (flat ``uint8`` views of the tensors' memory, no copy for CPU tensors).

    Raises:
        UnsupportedStateError: ``state`` holds a value this format does not store.
    """
    tree, records, tensors = encode_tree(state)
    body: dict[str, Any] = {"tree": tree, "tensors": records, "data_start": 0}
    # data_start depends on the header's length, which depends on data_start's digits
    for _ in range(3):
        text = json.dumps(body, separators=(",", ":")).encode()
        start = _align(_PREFIX.size + len(text), _PAGE)
        if body["data_start"] == start:
            break
        body["data_start"] = start
    text = json.dumps(body, separators=(",", ":")).encode()
    lead = _PREFIX.pack(MAGIC, len(text)) + text
    return lead + bytes(body["data_start"] - len(lead)), tensors


def _segments(lead: bytes, tensors: list[torch.Tensor]) -> list[memoryview]:
    views = [memoryview(lead)]
    pos = len(lead)
    for t in tensors:
        nbytes = t.numel()
        if nbytes == 0:
            continue
        start = len(lead) + _align(pos - len(lead), _ALIGN)
        if start > pos:
            views.append(memoryview(bytes(start - pos)))
        views.append(_memory_of(t))
        pos = start + nbytes
    return views


def _memory_of(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (no copy; ``t`` must outlive it)."""
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


def _write_all(
    fd: int, segments: list[memoryview], on_bytes: Callable[[int], None]
) -> tuple[int, int]:
    """Write ``segments`` in order in 16 MiB ``writev`` calls; return ``(bytes, crc32)``.

    Each piece is CRCed just before it is written, in this thread: the piece is then hot
    in the CPU cache for the kernel's copy, and ISA-L's CRC32 is cheaper than a thread
    hand-off. (Measured here against a CRC thread running alongside and 64 MiB writes:
    this was the fastest, at the speed of a raw write.)
    """
    total = 0
    crc = 0
    batch: list[memoryview] = []
    size = 0

    def flush() -> None:
        nonlocal batch, size, total
        while batch:
            n = os.writev(fd, batch)
            total += n
            while batch and n >= len(batch[0]):
                n -= len(batch[0])
                batch.pop(0)
            if batch and n:
                batch[0] = batch[0][n:]
        size = 0
        on_bytes(total)

    for seg in segments:
        for a in range(0, max(1, len(seg)), _BATCH_BYTES):
            piece = seg[a : a + _BATCH_BYTES]
            crc = crc32(piece, crc)
            batch.append(piece)
            size += len(piece)
            if size >= _BATCH_BYTES or len(batch) >= _IOV_MAX:
                flush()
    flush()
    return total, crc


def write_container(
    path: Path, lead: bytes, tensors: list[torch.Tensor], on_bytes: Callable[[int], None]
) -> tuple[int, int]:
    """Write an encoded state to a new file ``path``; return ``(size, crc32)``.

    Each 16 MiB piece is CRCed, then written (``writev``). Not fsynced here: the store's commit fsyncs it together
    with the manifest and the directory. ``on_bytes(total)`` is called after each large
    write.

    Raises:
        OSError: the write failed.
    """
    segments = _segments(lead, tensors)
    fd = create_new(path)
    try:
        return _write_all(fd, segments, on_bytes)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- read


def _open_checked(path: Path, expected_size: int, at: CheckpointDir | None) -> tuple[int, int]:
    """Open ``path`` (no links; through the held directory ``at`` when given: ours and
    private, checked on the open descriptor) and check it has the recorded size."""
    fd = open_data_file(path, at)
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            raise CheckpointCorruptError(
                f"checkpoint file {path} has {size} bytes, manifest says "
                f"{expected_size} (truncated or overwritten)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _read_into(fd: int, view: memoryview) -> int:
    """Read the file into ``view`` (its size); return its CRC32.

    Each chunk is CRCed right after it arrives, in this thread: with ISA-L's CRC32 that
    costs less than a thread hand-off, and the kernel's sequential read-ahead keeps the
    disk busy meanwhile. (Measured here: a helper thread or explicit ``WILLNEED``
    read-ahead windows were slower; huge pages for the buffer matter most.)
    """
    size = len(view)
    with suppress(OSError):
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
    crc = 0
    pos = 0
    while pos < size:
        n = os.preadv(fd, [view[pos : pos + _READ_CHUNK]], pos)
        if n == 0:
            raise CheckpointCorruptError(f"checkpoint file shrank while read ({pos} of {size})")
        crc = crc32(view[pos : pos + n], crc)
        pos += n
    return crc


class Parsed(NamedTuple):
    """A verified, parsed container: the state with CPU tensors, and how to rebuild it
    with the same tensors elsewhere (``decode_tree(tree, moved_tensors)``)."""

    state: Any
    tree: Any
    tensors: list[torch.Tensor]
    devices: list[str]  # where each tensor was saved from


def read_container(
    path: Path,
    *,
    expected_size: int,
    expected_crc: int,
    use_mmap: bool,
    at: CheckpointDir | None = None,
) -> Parsed:
    """Read, verify (size and CRC32 against the manifest record), then parse ``path``.

    Nothing of the file is parsed before every byte matched the CRC32. With ``use_mmap``
    the tensors are copy-on-write views of a private mapping of the file (the file is
    never changed through them); otherwise of one buffer the file was read into. Fault
    point ``"read_file"`` right after the open (tests only).

    Args:
        path: the file (its name is opened relative to ``at`` when given).
        expected_size: the manifest's size.
        expected_crc: the manifest's CRC32.
        use_mmap: map the file instead of reading it.
        at: the held, checked checkpoint directory (what was verified is what is read).

    Raises:
        CheckpointCorruptError: a size or CRC32 mismatch, a missing file, or a header or
            tree this writer never produces (the message names ``path``).
        CheckpointReadError: an I/O or memory error (the file is intact and stays).
        UntrustedCheckpointError: the file is not ours, writable by others, or a link.
    """
    fd, size = _open_checked(path, expected_size, at)
    try:
        _faults.point("read_file")
        buf: Any
        if use_mmap and size > 0:
            buf = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            crc = crc32_mapping(buf, size, _READ_CHUNK)
        else:
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with suppress(OSError, AttributeError):
                buf.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults while reading into it
            crc = _read_into(fd, memoryview(buf).cast("B")) if size else 0
    except (OSError, MemoryError) as exc:
        raise read_error(exc, f"checkpoint file {path}") from exc
    finally:
        os.close(fd)
    if crc != expected_crc:
        raise CheckpointCorruptError(
            f"checkpoint file {path} fails its CRC32 check ({crc:#010x} != "
            f"{expected_crc:#010x}; flipped bytes)"
        )
    try:
        tree, tensors, devices = _parse(buf)
        return Parsed(decode_tree(tree, tensors), tree, tensors, devices)
    except CheckpointCorruptError:
        raise
    except MemoryError as exc:
        raise read_error(exc, f"checkpoint file {path}") from exc
    except Exception as exc:
        raise CheckpointCorruptError(
            f"checkpoint file {path} verified but its header cannot be parsed "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _int(value: Any, what: str) -> int:
    if type(value) is not int:  # bool, float and str are not sizes
        raise CheckpointCorruptError(f"bad {what} {value!r:.80}: not an integer")
    return value


class Record:
    """One validated tensor record: where its bytes are and what they hold."""

    __slots__ = ("device", "dtype", "nbytes", "numel", "offset", "shape")

    def __init__(
        self, dtype: torch.dtype, shape: list[int], offset: int, nbytes: int, device: str
    ) -> None:
        self.dtype, self.shape, self.offset, self.nbytes, self.device = (
            dtype,
            shape,
            offset,
            nbytes,
            device,
        )
        self.numel = nbytes // max(1, _itemsize(dtype))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_records(records: Any, data_size: int) -> list[Record]:
    """Validate tensor records as only the writer produces them.

    Every dtype is one the writer emits (:data:`DTYPES`); shapes are lists of
    non-negative integers; offsets are non-negative, 64-byte aligned integers; each
    tensor's bytes (``nbytes`` = elements times item size) lie inside ``data_size`` and no
    two tensors overlap; devices are real device names (no ``meta``).

    Raises:
        CheckpointCorruptError: any record breaks a rule (the message names it).
    """
    if type(records) is not list:
        raise CheckpointCorruptError(f"bad tensor table {records!r:.80}")
    checked: list[Record] = []
    for rec in records:
        if type(rec) is not dict:
            raise CheckpointCorruptError(f"bad tensor record {rec!r:.80}")
        name = rec.get("dtype")
        if type(name) is not str or name not in DTYPES:
            raise CheckpointCorruptError(
                f"tensor record with dtype {name!r:.40}: not one this format writes"
            )
        dtype = DTYPES[name]
        shape = rec.get("shape")
        if type(shape) is not list or len(shape) > 64:
            raise CheckpointCorruptError(f"bad shape {shape!r:.80}")
        numel = 1
        for dim in shape:
            if _int(dim, "shape dimension") < 0:
                raise CheckpointCorruptError(f"bad shape {shape}: negative dimension")
            numel *= dim
        offset = _int(rec.get("offset"), "tensor offset")
        nbytes = _int(rec.get("nbytes"), "tensor size")
        device = rec.get("device")
        if type(device) is not str or device.split(":", 1)[0] not in _DEVICE_TYPES:
            raise CheckpointCorruptError(f"tensor record with device {device!r:.40}")
        if offset < 0 or offset % _ALIGN or nbytes != numel * _itemsize(dtype):
            raise CheckpointCorruptError(f"bad tensor record {rec!r:.200}")
        if offset + nbytes > data_size:
            raise CheckpointCorruptError(
                f"tensor record {rec!r:.200} reaches past the data ({data_size} bytes)"
            )
        checked.append(Record(dtype, shape, offset, nbytes, device))
    spans = sorted((r.offset, r.offset + r.nbytes) for r in checked if r.nbytes)
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointCorruptError(f"overlapping tensors at offset {start}")
    return checked


def _parse(buf: Any) -> tuple[Any, list[torch.Tensor], list[str]]:
    """``(tree, tensors, saved devices)``: the header checked, every tensor a CPU view of
    ``buf`` (no device move here: a device error is not damage)."""
    view = memoryview(buf).cast("B")
    size = len(view)
    magic, hlen = _PREFIX.unpack(bytes(view[: _PREFIX.size]))
    if magic != MAGIC or not 0 < hlen <= min(_MAX_HEADER, size - _PREFIX.size):
        raise CheckpointCorruptError(f"not a slurm_elastic state file (magic {magic!r})")
    header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + hlen]))
    view.release()
    if type(header) is not dict:
        raise CheckpointCorruptError("bad header: not an object")
    start = header.get("data_start")
    if type(start) is not int or not _PREFIX.size + hlen <= start <= size:
        raise CheckpointCorruptError(f"bad data_start {start!r}")
    tensors = []
    devices = []
    for rec in check_records(header.get("tensors"), size - start):
        if rec.nbytes == 0:
            t = torch.empty(rec.shape, dtype=rec.dtype)
        else:  # its own storage (offset 0) inside buf; it keeps buf alive
            t = torch.frombuffer(buf, dtype=rec.dtype, count=rec.numel, offset=start + rec.offset)
            t = t.view(rec.shape)
        tensors.append(t)
        devices.append(rec.device)
    return header.get("tree"), tensors, devices


def decode_tree(node: Any, tensors: list[Any]) -> Any:
    """The value of an :func:`encode_tree` tree, ``{"T": i}`` replaced by ``tensors[i]``.

    Raises:
        CheckpointCorruptError: a node this format never writes (unknown tag, bad index,
            bad value), never anything else.
    """
    try:
        return _decode(node, tensors)
    except CheckpointCorruptError:
        raise
    except (ValueError, TypeError, RuntimeError, RecursionError, KeyError) as exc:
        raise CheckpointCorruptError(f"bad tree ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _decode(node: Any, tensors: list[Any]) -> Any:
    if node is None or type(node) in (bool, int, str, float):
        return node
    if type(node) is list:
        return [_decode(v, tensors) for v in node]
    if type(node) is not dict or len(node) != 1:
        raise CheckpointCorruptError(f"bad tree node {node!r:.80}")
    ((tag, value),) = node.items()
    if tag == "T":
        if type(value) is not int or not 0 <= value < len(tensors):
            raise CheckpointCorruptError(f"bad tensor reference {value!r:.40}")
        return tensors[value]
    if tag in ("t", "S", "c", "d", "o") and type(value) is not list:
        raise CheckpointCorruptError(f"bad tree node {node!r:.80}")
    if tag == "t":
        return tuple(_decode(v, tensors) for v in value)
    if tag in ("d", "o"):
        pairs = []
        for pair in value:
            if type(pair) is not list or len(pair) != 2:
                raise CheckpointCorruptError(f"bad mapping item {pair!r:.80}")
            pairs.append((_decode(pair[0], tensors), _decode(pair[1], tensors)))
        return dict(pairs) if tag == "d" else OrderedDict(pairs)
    if tag == "S":
        return torch.Size(_int(v, "size") for v in value)
    if tag == "b" and type(value) is str:
        return base64.b64decode(value, validate=True)
    if tag == "c" and len(value) == 2 and all(type(v) in (int, float) for v in value):
        return complex(float(value[0]), float(value[1]))
    if tag == "y" and type(value) is str and value in DTYPES:
        return DTYPES[value]
    if tag == "v" and type(value) is str and value.split(":", 1)[0] in _DEVICE_TYPES:
        return torch.device(value)
    raise CheckpointCorruptError(f"bad tree node {node!r:.80}")
