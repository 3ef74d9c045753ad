"""Sparse deltas between two versions' files, and their reconstruction checked bit for bit.

A delta version carries two files (shardcast/README.md, "Deltas"):

- `delta-index.json`: one entry per file of the new version: `same` (the base's file, unchanged),
  `whole` (the new file's bytes, at `at`/`size` in the values file) or `patch` (the base's file with
  changed elements replaced). A patch lists regions of fixed element width (one per tensor of a
  safetensors file whose header is unchanged): `count` changed positions (in elements from the region's
  start, strictly increasing) as `pos_bytes` bytes of gaps (the first position, then each one's distance
  from the one before) in LEB128 (7 bits a byte, low first, the high bit set on every byte but a value's
  last), followed by the `count` new element values, stored at `at` in the values file. At the 1-5 % of
  bf16 elements an RL step changes, a gap takes one or two bytes where an absolute position took four.
  A region where most elements changed (fp32 weights under Adam: every element moves a little) is coded instead
  as `xor` (`coding: "xor"`): the bitwise XOR of the old and new elements, `plane` elements at a time split
  into byte planes (those elements' first bytes, then their second bytes, ...), deflated as one zlib stream of
  `xor_bytes` bytes at `at`. Small updates leave the sign, the exponent and the high mantissa bits
  alone, so those planes are nearly all zeros; it is used only where it is smaller than the positions and values
  would at least be. `shardcast-delta/1` (absolute positions of `pos_width` bytes) and `/2` (no `xor`) are still
  read.
- `delta-values.bin`: the bytes the index points into.

Elements are compared as raw bit patterns of their width, so a delta is exact in any dtype (bf16 and
NaN included) and needs no float arithmetic. Reconstruction writes new files and never touches the
base's; the result is accepted only when every shard of it hashes to the signed full-weight table
(`DeltaMismatchError` otherwise), and a base whose weights hash is not the one the delta names is
refused before anything is read (`DeltaBaseError`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from shardcast.errors import DeltaBaseError, DeltaError, DeltaMismatchError
from shardcast.manifest import FileEntry, Manifest, ShardEntry, valid_file_name

INDEX_FILE = "delta-index.json"
VALUES_FILE = "delta-values.bin"
FORMAT = "shardcast-delta/3"
READ_FORMATS = ("shardcast-delta/1", "shardcast-delta/2", FORMAT)
_MAX_INDEX_BYTES = 64 * 1024 * 1024
_ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                  "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
BLOCK = 1 << 22
"""Elements compared, and positions or XOR planes coded or decoded, at a time (the work memory of a delta is per
block)."""
XOR_PLANE = 1 << 16
"""Elements split into byte planes together (a region's `plane`: part of the format, unlike `BLOCK`)."""
_MAX_PLANE = 1 << 22
XOR_LEVEL = 1
"""zlib's level for XOR planes: the zero planes deflate at any level; the random low mantissa bits at none."""
_INFLATE_READ = 1 << 20
_COMPARE = 1 << 24
"""Bytes compared at a time when deciding whether a file changed."""


@dataclass(frozen=True)
class DeltaStats:
    """What a delta holds, against the full version it reproduces."""

    delta_bytes: int
    full_bytes: int
    changed_elements: int
    total_elements: int

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


def _mapped(path: Path) -> np.ndarray:
    """A file's bytes, mapped read-only (read on demand from the page cache, never copied whole)."""
    return np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two mapped files hold the same bytes, compared `_COMPARE` bytes at a time up to the first
    difference (no temporary the size of a file)."""
    return len(a) == len(b) and all(np.array_equal(a[lo:lo + _COMPARE], b[lo:lo + _COMPARE])
                                    for lo in range(0, len(a), _COMPARE))


def _regions(data: np.ndarray) -> tuple[bytes, list[tuple[int, int, int]]] | None:
    """(header bytes, [(start, stop, element width)]) of a safetensors file, or None when it is not one."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    if 8 + n > len(data):
        return None
    try:
        header = json.loads(data[8:8 + n].tobytes())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    regions = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            width = _ELEMENT_BYTES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            return None
        if not 0 <= start <= stop or 8 + n + stop > len(data) or (stop - start) % width:
            return None
        regions.append((8 + n + start, 8 + n + stop, width))
    return data[:8 + n].tobytes(), sorted(regions)


def make_delta(base_dir: Path, new_dir: Path, out_dir: Path, names: list[str]) -> DeltaStats:
    """Write `out_dir/INDEX_FILE` and `out_dir/VALUES_FILE`: the delta turning `base_dir` into `new_dir`
    for the files `names` (relative paths of the new version, in its manifest's order)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    changed = total = full = 0
    with open(out_dir / VALUES_FILE, "wb") as values:
        for name in names:
            new = _mapped(new_dir / name)
            full += len(new)
            base_path = base_dir / name
            base = _mapped(base_path) if base_path.is_file() else None
            if base is not None and _same(base, new):
                entries.append({"path": name, "op": "same", "size": len(new)})
                continue
            parsed = _regions(new) if base is not None and len(base) == len(new) else None
            if parsed is None or base is None or base[:len(parsed[0])].tobytes() != parsed[0]:
                entries.append({"path": name, "op": "whole", "size": len(new), "at": values.tell()})
                values.write(new.data)
                continue
            regions = []
            for start, stop, width in parsed[1]:
                region = _write_region(base, new, start, stop, width, values)
                total += (stop - start) // width
                if region is not None:
                    changed += region["count"]
                    regions.append(region)
            entries.append({"path": name, "op": "patch", "size": len(new), "regions": regions})
    index = json.dumps({"format": FORMAT, "files": entries}, sort_keys=True, separators=(",", ":")).encode()
    (out_dir / INDEX_FILE).write_bytes(index)
    return DeltaStats(delta_bytes=len(index) + (out_dir / VALUES_FILE).stat().st_size, full_bytes=full,
                      changed_elements=changed, total_elements=total)


def _elements(data: np.ndarray, kind: Any, start: int, width: int, lo: int, n: int) -> np.ndarray:
    return np.frombuffer(data, dtype=kind, count=n, offset=start + lo * width)


def _write_region(base: np.ndarray, new: np.ndarray, start: int, stop: int, width: int, values: Any) -> dict[str, Any] | None:
    """Append one tensor's change to `values`, coded as XOR planes (`_write_xor`) when more than half of its bytes
    would go to positions and values and the planes come out smaller, else as its changed positions and their new
    values (`_write_sparse`); its index entry, or None when nothing changed."""
    kind, elements = _UINT[width], (stop - start) // width
    count = sum(int(np.count_nonzero(_elements(base, kind, start, width, lo, min(BLOCK, elements - lo))
                                     != _elements(new, kind, start, width, lo, min(BLOCK, elements - lo))))
                for lo in range(0, elements, BLOCK))
    if not count:
        return None
    sparse_least = count * (width + 1)  # a value and at least one byte of gap each
    if 2 * sparse_least > stop - start:
        at = values.tell()
        xor_bytes = _write_xor(base, new, start, stop, width, values)
        if xor_bytes < sparse_least:
            return {"start": start, "stop": stop, "width": width, "count": count, "coding": "xor",
                    "plane": XOR_PLANE, "xor_bytes": xor_bytes, "at": at}
        values.seek(at)
        values.truncate()
    return _write_sparse(base, new, start, stop, width, values)


def _write_xor(base: np.ndarray, new: np.ndarray, start: int, stop: int, width: int, values: Any) -> int:
    """Append the region's XOR planes, deflated (see the module docstring); returns the bytes written."""
    kind, elements = _UINT[width], (stop - start) // width
    deflate, written = zlib.compressobj(XOR_LEVEL), 0
    for lo in range(0, elements, XOR_PLANE):
        n = min(XOR_PLANE, elements - lo)
        xor = _elements(base, kind, start, width, lo, n) ^ _elements(new, kind, start, width, lo, n)
        planes = np.ascontiguousarray(xor.view(np.uint8).reshape(n, width).T)
        written += values.write(deflate.compress(planes.tobytes()))
    return written + int(values.write(deflate.flush()))


def _write_sparse(base: np.ndarray, new: np.ndarray, start: int, stop: int, width: int, values: Any) -> dict[str, Any] | None:
    """Append one tensor's changed positions (coded) and then their new values to `values`; its index entry, or
    None when nothing changed. Compared `BLOCK` elements at a time: the extra memory is the region's new values
    and one block's work, whatever the tensor's size (a 62 GB version's tensors are gigabytes each)."""
    kind, elements, at = _UINT[width], (stop - start) // width, values.tell()
    count = pos_bytes = 0
    last = 0  # the position a block's first gap is counted from
    changed_values: list[bytes] = []
    for lo in range(0, elements, BLOCK):
        n = min(BLOCK, elements - lo)
        old_el, new_el = _elements(base, kind, start, width, lo, n), _elements(new, kind, start, width, lo, n)
        positions = np.flatnonzero(old_el != new_el)
        if not len(positions):
            continue
        coded = encode_positions(positions + lo, after=last)
        values.write(coded)
        changed_values.append(new_el[positions].tobytes())
        count, pos_bytes, last = count + len(positions), pos_bytes + len(coded), lo + int(positions[-1])
    if not count:
        return None
    for chunk in changed_values:
        values.write(chunk)
    return {"start": start, "stop": stop, "width": width, "count": count, "pos_bytes": pos_bytes, "at": at}


def encode_positions(positions: np.ndarray, after: int = 0) -> bytes:
    """Strictly increasing non-negative positions as LEB128 gaps, the first from `after` (0: a list's first
    position is its own gap; a block of a longer list passes the list's position before it). `BLOCK` positions at
    a time: about 48 bytes of work per position of a block, not per position of the list."""
    out = []
    for lo in range(0, len(positions), BLOCK):
        prev = after if lo == 0 else int(positions[lo - 1])
        out.append(_leb128(np.diff(positions[lo:lo + BLOCK].astype(np.uint64), prepend=np.uint64(prev))))
    return b"".join(out)


def _leb128(gaps: np.ndarray) -> bytes:
    if not len(gaps):
        return b""
    lengths = np.ones(len(gaps), dtype=np.int64)
    for extra in range(1, 10):  # bytes per gap: 7 bits each
        lengths += gaps >= np.uint64(1) << np.uint64(7 * extra)
    owner = np.repeat(np.arange(len(gaps)), lengths)
    first = np.cumsum(lengths) - lengths
    shift = (np.arange(len(owner)) - first[owner]).astype(np.uint64) * np.uint64(7)
    out = ((gaps[owner] >> shift) & np.uint64(0x7F)).astype(np.uint8)
    out[np.arange(len(owner)) != (first + lengths - 1)[owner]] |= 0x80
    return bytes(out.tobytes())


def decode_positions(coded: bytes | np.ndarray, count: int) -> np.ndarray:
    """The `count` positions `encode_positions` wrote as `coded`, as int64 (`iter_positions`, joined)."""
    blocks = list(iter_positions(coded, count))
    return np.concatenate(blocks) if blocks else np.zeros(0, np.int64)


def iter_positions(coded: bytes | np.ndarray, count: int) -> Iterator[np.ndarray]:
    """The `count` positions `encode_positions` wrote as `coded`, as int64 blocks of at most `BLOCK`, in order;
    `DeltaError` for anything else (bytes that are not exactly `count` gaps, a gap over 63 bits, positions not
    strictly increasing), raised at the block where it shows (a caller applies nothing it has not checked: the
    positions it was given so far are valid, and the result is checked against the signed hashes anyway)."""
    b = np.frombuffer(coded, dtype=np.uint8)
    if not count or not len(b) or b[-1] >= 0x80:
        if count or len(b):
            raise DeltaError(f"delta positions: {len(b)} bytes do not hold exactly {count} gaps")
        return
    seen, at, prev = 0, 0, None
    while at < len(b):
        window = b[at:at + 9 * BLOCK]
        ends = np.flatnonzero(window < 0x80)[:BLOCK]  # the last byte of each gap
        if not len(ends):
            raise DeltaError("delta positions: a gap longer than 63 bits")
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts + 1
        if lengths.max() > 9:
            raise DeltaError("delta positions: a gap longer than 63 bits")
        seen += len(ends)
        if seen > count:
            raise DeltaError(f"delta positions: {len(b)} bytes hold more than {count} gaps")
        chunk = window[:int(ends[-1]) + 1]
        owner = np.repeat(np.arange(len(ends)), lengths)
        shift = (np.arange(len(chunk)) - starts[owner]).astype(np.uint64) * np.uint64(7)
        gaps = np.add.reduceat((chunk & 0x7F).astype(np.uint64) << shift, starts)
        # a sum past 2**64 wraps below the one before: refused with the rest
        positions = np.cumsum(gaps, dtype=np.uint64) + np.uint64(0 if prev is None else prev)
        if (np.any(positions[1:] <= positions[:-1]) or (prev is not None and positions[0] <= np.uint64(prev))
                or positions[-1] >= np.uint64(1 << 62)):
            raise DeltaError("delta positions: not strictly increasing")
        prev, at = int(positions[-1]), at + len(chunk)
        yield positions.astype(np.int64)
    if seen != count:
        raise DeltaError(f"delta positions: {len(b)} bytes do not hold exactly {count} gaps")


def _int(entry: dict[str, Any], key: str) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DeltaError(f"delta index: {key!r} must be a non-negative integer, not {value!r}")
    return value


def _load_index(delta_dir: Path, manifest: Manifest) -> list[dict[str, Any]]:
    path = delta_dir / INDEX_FILE
    try:
        if path.stat().st_size > _MAX_INDEX_BYTES:
            raise DeltaError(f"delta index of {path.stat().st_size} bytes exceeds {_MAX_INDEX_BYTES}")
        index = json.loads(path.read_bytes())
    except OSError as exc:
        raise DeltaError(f"delta index unreadable: {exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise DeltaError(f"delta index is not JSON: {exc}") from exc
    if not isinstance(index, dict) or index.get("format") not in READ_FORMATS or not isinstance(index.get("files"),
                                                                                               list):
        raise DeltaError(f"delta index is not one of {', '.join(READ_FORMATS)}")
    entries = index["files"]
    wanted = [f.path for f in manifest.weight_files]
    if [e.get("path") if isinstance(e, dict) else None for e in entries] != wanted:
        raise DeltaError("delta index does not list the files of the version it produces, in order")
    return list(entries)


def apply_delta(base_dir: Path, base: Manifest, delta_dir: Path, manifest: Manifest, out_dir: Path) -> None:
    """Write the full files of delta version `manifest` into `out_dir` from the base's files (`base_dir`,
    checked against `base`, its installed manifest) and the delta's (`delta_dir`); then check every shard
    of the result against the signed full-weight table. Raises `DeltaBaseError` for another base,
    `DeltaError` for a malformed delta, `DeltaMismatchError` when the result is not the signed weights."""
    ref = manifest.delta
    if ref is None:
        raise DeltaError(f"v{manifest.version} is not a delta")
    if base.version != ref.base_version or base.weights_hash() != ref.base_weights:
        raise DeltaBaseError(f"v{manifest.version} is a delta against v{ref.base_version} (weights "
                             f"{ref.base_weights[:12]}), not v{base.version} (weights {base.weights_hash()[:12]})")
    entries = _load_index(delta_dir, manifest)
    base_sizes = {f.path: f.size for f in base.weight_files}
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        values = np.memmap(delta_dir / VALUES_FILE, dtype=np.uint8, mode="r") \
            if (delta_dir / VALUES_FILE).stat().st_size else np.zeros(0, np.uint8)
    except OSError as exc:
        raise DeltaError(f"delta values unreadable: {exc}") from exc
    for entry, wanted in zip(entries, manifest.weight_files, strict=True):
        name, op, size = wanted.path, entry.get("op"), _int(entry, "size")
        if size != wanted.size or not valid_file_name(name):
            raise DeltaError(f"delta index: {name} has size {size}, the signed table says {wanted.size}")
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # never write through a link to a base file left by an earlier attempt
        if op == "whole":
            at = _int(entry, "at")
            if at + size > len(values):
                raise DeltaError(f"delta index: {name} reaches past the values file")
            with open(target, "wb") as fh:
                fh.write(values[at:at + size].data)
            continue
        if op not in ("same", "patch"):
            raise DeltaError(f"delta index: {name} has unknown op {op!r}")
        if base_sizes.get(name) != size:
            raise DeltaBaseError(f"delta index: {name} of {size} bytes has no base file of that size")
        if op == "same":
            try:
                os.link(base_dir / name, target)  # installed files are never written in place
            except OSError:
                shutil.copyfile(base_dir / name, target)
            continue
        regions = entry.get("regions")
        if not isinstance(regions, list):
            raise DeltaError(f"delta index: {name} has no region list")
        _patched_copy(base_dir / name, target, size, regions, values)
    _check_result(out_dir, manifest)


def _patched_copy(source: Path, target: Path, size: int, regions: list[Any], values: np.ndarray) -> None:
    """`target` as `source` with `regions` applied: the kernel copies the file (no pass through Python), the
    regions are written into the copy through a shared mapping, so only the pages they touch are handled here."""
    shutil.copyfile(source, target)
    if target.stat().st_size != size:
        raise DeltaMismatchError(f"the base's {source} is {target.stat().st_size} bytes on disk, its manifest "
                                 f"says {size}")
    data: np.ndarray = np.memmap(target, dtype=np.uint8, mode="r+") if size else np.zeros(0, np.uint8)
    for region in regions:
        _patch(data, region, values, target.name)


def _patch(data: np.ndarray, region: Any, values: np.ndarray, name: str) -> None:
    if not isinstance(region, dict):
        raise DeltaError(f"delta index: {name} has a region that is not an object")
    start, stop, width = _int(region, "start"), _int(region, "stop"), _int(region, "width")
    count, at = _int(region, "count"), _int(region, "at")
    if width not in _UINT or not start <= stop <= len(data) or (stop - start) % width:
        raise DeltaError(f"delta index: {name} has a bad region {start}..{stop} of width {width}")
    if region.get("coding", "sparse") not in ("sparse", "xor"):
        raise DeltaError(f"delta index: {name} has a region coded {region.get('coding')!r}")
    if region.get("coding") == "xor":
        _unxor(data, region, values, name, start, stop, width, count, at)
        return
    if "pos_bytes" in region:  # shardcast-delta/2: LEB128 gaps
        pos_bytes = _int(region, "pos_bytes")
        end = at + pos_bytes + count * width
        if end > len(values):
            raise DeltaError(f"delta index: {name} region at {start} reaches past the values file")
        blocks: Iterator[np.ndarray] = iter_positions(values[at:at + pos_bytes], count)
    else:  # shardcast-delta/1: absolute positions
        pos_width = _int(region, "pos_width")
        if pos_width not in (4, 8):
            raise DeltaError(f"delta index: {name} has positions of {pos_width} bytes")
        pos_bytes = count * pos_width
        end = at + pos_bytes + count * width
        if end > len(values):
            raise DeltaError(f"delta index: {name} region at {start} reaches past the values file")
        positions = np.frombuffer(values[at:at + pos_bytes].tobytes(), dtype=f"<u{pos_width}").astype(np.int64)
        if count > 1 and np.any(np.diff(positions) <= 0):
            raise DeltaError(f"delta index: {name} region at {start} has positions out of order")
        blocks = iter([positions] if count else [])
    elements = (stop - start) // width
    view = np.frombuffer(data, dtype=_UINT[width], count=elements, offset=start)
    new_values = np.frombuffer(values[at + pos_bytes:end], dtype=_UINT[width])
    done = 0
    for positions in blocks:
        if positions[-1] >= elements or positions[0] < 0:
            raise DeltaError(f"delta index: {name} region at {start} has positions out of range")
        view[positions] = new_values[done:done + len(positions)]
        done += len(positions)


def _unxor(data: np.ndarray, region: dict[str, Any], values: np.ndarray, name: str, start: int, stop: int,
           width: int, count: int, at: int) -> None:
    """Apply an `xor` region: inflated `plane` elements at a time, never past their bytes (a stream that would
    inflate to more than the region is refused where it passes it, whatever its ratio)."""
    xor_bytes, plane = _int(region, "xor_bytes"), _int(region, "plane")
    if not 1 <= plane <= _MAX_PLANE:
        raise DeltaError(f"delta index: {name} region at {start} has XOR planes of {plane} elements")
    if at + xor_bytes > len(values):
        raise DeltaError(f"delta index: {name} region at {start} reaches past the values file")
    kind, elements = _UINT[width], (stop - start) // width
    view = np.frombuffer(data, dtype=kind, count=elements, offset=start)
    source = values[at:at + xor_bytes]
    inflate, read, changed = zlib.decompressobj(), 0, 0

    def more(limit: int) -> bytes:
        """Up to `limit` more bytes (b"": the input is spent and nothing is pending)."""
        nonlocal read
        chunk = inflate.unconsumed_tail
        if not chunk and read < xor_bytes:
            chunk, read = source[read:read + _INFLATE_READ].tobytes(), min(read + _INFLATE_READ, xor_bytes)
        try:
            return inflate.decompress(chunk, limit)  # b"" in: what a long match left pending comes out
        except zlib.error as exc:
            raise DeltaError(f"delta index: {name} region at {start}: XOR planes do not inflate ({exc})") from exc

    def spent() -> bool:
        return read >= xor_bytes and not inflate.unconsumed_tail

    for lo in range(0, elements, plane):
        n = min(plane, elements - lo)
        parts, have = [], 0
        while have < n * width:
            part = b"" if inflate.eof else more(n * width - have)
            if not part and (inflate.eof or spent()):
                raise DeltaError(f"delta index: {name} region at {start}: XOR planes end before the region does")
            parts.append(part)
            have += len(part)
        planes = np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(width, n)
        xor = np.ascontiguousarray(planes.T).view(kind).reshape(n)
        changed += int(np.count_nonzero(xor))
        view[lo:lo + n] ^= xor
    while not inflate.eof:
        if more(1):
            raise DeltaError(f"delta index: {name} region at {start}: XOR planes hold more than the region")
        if spent():
            break
    if not inflate.eof or inflate.unused_data or inflate.unconsumed_tail or read < xor_bytes:
        raise DeltaError(f"delta index: {name} region at {start}: XOR planes are not one stream of {xor_bytes} "
                         "bytes that ends with the region")
    if changed != count:
        raise DeltaError(f"delta index: {name} region at {start} changes {changed} elements, not {count}")


def _check_result(out_dir: Path, manifest: Manifest) -> None:
    """Every shard of the reconstructed files against the signed full-weight table, bit for bit (hashed from
    a mapping of each file: the bytes just written are still in the page cache, and are not copied again)."""
    files: tuple[FileEntry, ...] = manifest.weight_files
    shards: tuple[ShardEntry, ...] = manifest.weight_shards
    for index, f in enumerate(files):
        path = out_dir / f.path
        if path.stat().st_size != f.size:
            raise DeltaMismatchError(f"v{manifest.version}: {f.path} came out at the wrong size")
        data = np.memmap(path, dtype=np.uint8, mode="r") if f.size else np.zeros(0, np.uint8)
        for shard in (s for s in shards if s.file == index):
            digest = blake3.blake3(data[shard.offset:shard.offset + shard.size].data).hexdigest()
            if digest != shard.hash:
                raise DeltaMismatchError(f"v{manifest.version}: the delta reproduces {f.path} bytes "
                                         f"{shard.offset}..{shard.offset + shard.size} with hash {digest[:12]}, "
                                         f"the signed weights say {shard.hash[:12]}")
