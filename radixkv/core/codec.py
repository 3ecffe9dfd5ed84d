"""Codecs: how a chunk's KV payload is written below the CPU tier, smaller than raw.

A chunk (``radixkv.core.format``) stores its KV raw by default (codec ``none``).  A tier may
store it coded instead; the chunk's header then names the codec and its parameter, under the
chunk's seal, so a reader never guesses and decodes whatever its own setting is.  The pool and
the CPU tier always hold raw KV.

=========  ====  =======  ==============================================================================
name       code  exact    payload
=========  ====  =======  ==============================================================================
none       0     yes      the raw values, ``[num_layers, sides, tokens, heads, head_dim]``, C order
zstd       1     yes      the raw values' bytes split into byte planes (all first bytes, then all
                          second bytes, ...), then one zstd frame: lossless entropy coding
int8       2     **no**   per channel (a layer, side, head and dimension, over the chunk's tokens):
                          its minimum and step (float32), then one uint8 code per value,
                          ``value ~= minimum + code * step``, ``step = (max - min) / 255``
cachegen   3     **no**   CacheGen-class (delta to anchors, precision per layer, entropy coding): per
                          layer and side a reference (the first token of each group of 16 tokens,
                          or, where that spreads the deltas more, the channel's midpoint), each
                          value's delta to it quantised symmetrically per channel with the layer's
                          bits (``layer_bits``: earlier layers get more), the codes packed (two to
                          a byte, plus a plane of high bits above 4 bits) in one zstd frame a layer
=========  ====  =======  ==============================================================================

**The error bound** (what the property tests check).  ``int8`` and ``cachegen`` write codes whose
dequantised value is within half a step of the input, per channel: for ``int8`` ``(max - min) /
510``; for ``cachegen`` ``max |delta| / (2 * (2**(bits - 1) - 1))``, ``bits`` of the layer, and
``max |delta| <= (max - min) * (1 + 1/510)`` whichever reference the channel's side uses (anchors
are dequantised before the deltas are taken, so their own error never adds up).  The decoded
value is then rounded to the KV's dtype: ``|decoded - value| <= half step + the dtype's rounding``
(half an ulp of ``float16``/``bfloat16`` at the value).
Constant channels decode exactly (up to float32 arithmetic flushing a subnormal value to zero).

**What is never coded.**  A chunk with a non-finite value (lossy codecs), a dtype that is not a
float of 16 or 32 bits, or whose coded payload would not be smaller than the raw one, is stored
raw: a codec never makes a chunk larger or its values wrong, only, when lossy, approximate.

**Trust.**  A coded payload is verified by the chunk's seal before it is decoded, and decoding
still trusts nothing in it: every length is checked against the shape the reader expects, zstd
frames are decompressed into exactly the expected size and no more, and any mismatch is a
``ValueError`` that ``radixkv.core.format`` turns into a ``ChunkFormatError`` (a miss).  ``out``
is written only by the last step of a decode, after everything has been checked.

The entropy coder is zstd (the ``zstandard`` bindings, the ``codec`` extra): byte-oriented
Huffman plus matching, in C, decoding at GB/s on one core; quantised codes cluster near zero,
which its Huffman stage turns into few bits (on packed codes within a few hundredths of a bit of
their entropy).  A range coder would code closer to the entropy but decode several times slower,
and decode speed is the budget a load lives within.  The last step of a lossy decode (unpack,
scale, offset) is one pass of the extension's ``dequantize`` where it is built
(``cuda_ext/dequantize.cpp``), else a few numpy/torch passes a layer; both give the same bits.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["CODECS", "Codec", "codec_by_code", "get_codec", "lossy_code"]

_GROUP = 16          # tokens per anchor group (cachegen)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ZSTD_LEVEL = 1     # higher levels look for matches that quantised codes do not have


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ImportError("the zstd and cachegen codecs need the zstandard package: "
                          "pip install 'radixkv[codec]'") from None
    return zstandard


def _decompress(frame: memoryview, size: int, decompressor: Any = None) -> bytes:
    """Exactly ``size`` bytes out of one zstd frame, never more (a frame that says otherwise, or
    is not one, raises ``ValueError``)."""
    zstd = _zstd()
    try:
        out = (decompressor or zstd.ZstdDecompressor()).decompress(frame, max_output_size=size)
    except zstd.ZstdError as exc:
        raise ValueError(f"coded payload: not a zstd frame of {size} bytes ({exc})") from None
    if len(out) != size:
        raise ValueError(f"coded payload: the zstd frame holds {len(out)} bytes, expected {size}")
    return out


def _values(kv: torch.Tensor) -> torch.Tensor:
    return kv.detach().to("cpu").contiguous()


class Codec:
    """One way of writing a chunk's KV payload: a small strategy object (``name``, ``code`` in
    the chunk header, ``lossy``) with ``encode`` and ``decode``.  Stateless and thread-safe."""

    name = "none"
    code = 0
    lossy = False
    entropy_coded = False      # needs zstd

    @property
    def key(self) -> tuple[int, int]:
        """What makes two codecs write the same blobs: the header code and the parameter choice."""
        return (self.code, 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def wrote(self, code: int, param: int) -> bool:
        """Whether a chunk whose header names codec ``code`` with ``param`` is one this codec
        writes (the same blob it would store).  O(1)."""
        return code == self.code

    def ready(self) -> None:
        """Raise ``ImportError`` (naming the extra to install) when a library this codec needs is
        missing.  O(1) after the first call."""
        if self.entropy_coded:
            _zstd()

    def encode(self, kv: torch.Tensor) -> tuple[int, bytes] | None:
        """``(parameter, payload)`` for ``kv`` (``[layers, sides, tokens, heads, head_dim]``), or
        ``None`` where this codec does not apply (then the chunk is stored raw).  O(size)."""
        return None

    def decode(self, payload: memoryview, param: int, dtype: torch.dtype, shape: tuple[int, ...],
               out: torch.Tensor | None) -> torch.Tensor:
        """The KV ``payload`` codes, as a ``dtype`` tensor of ``shape`` (in ``out`` if given, any
        device).  Raises ``ValueError`` for a payload that is not one of this codec's for that
        shape (then ``out`` is untouched).  O(size)."""
        raise ValueError(f"codec {self.name} has no coded payload")

    def __repr__(self) -> str:
        return f"Codec({self.name})"


def _finish(values: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
    """Write the decoded ``values`` (float32 or ``dtype``, ``shape``) into ``out`` or a new tensor:
    the only step of a decode that writes ``out``."""
    values = values.reshape(shape)
    if out is None:
        return values.to(dtype) if values.dtype != dtype else values
    out.copy_(values)
    return out


class _Zstd(Codec):
    """Lossless: byte planes, then zstd."""

    name, code, lossy, entropy_coded = "zstd", 1, False, True

    def encode(self, kv: torch.Tensor) -> tuple[int, bytes] | None:
        if kv.dtype not in _FLOATS or not kv.numel():
            return None
        raw = _values(kv).reshape(-1).view(torch.uint8).numpy()
        planes = raw.reshape(-1, kv.element_size()).T.copy()
        return 0, _zstd().ZstdCompressor(level=_ZSTD_LEVEL).compress(planes.data)

    def decode(self, payload: memoryview, param: int, dtype: torch.dtype, shape: tuple[int, ...],
               out: torch.Tensor | None) -> torch.Tensor:
        if param != 0 or dtype not in _FLOATS:
            raise ValueError(f"zstd codec: parameter {param} or dtype {dtype} not one it writes")
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = int(np.prod(shape, dtype=np.int64))
        planes = np.frombuffer(_decompress(payload, count * itemsize), np.uint8).reshape(itemsize, count)
        interleaved = np.empty((count, itemsize), np.uint8)
        interleaved[:] = planes.T
        values = torch.from_numpy(interleaved.reshape(-1)).view(dtype)
        return _finish(values, dtype, shape, out)


def _quantize_minmax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(minimum, step, codes)`` of ``x`` over ``dim``: uint8 codes, ``x ~= minimum + code * step``
    within half a step; a constant channel has step 0 and codes 0."""
    lo = x.amin(dim=dim, keepdim=True)
    step = (x.amax(dim=dim, keepdim=True) - lo) / 255
    safe = torch.where(step > 0, step, 1)
    codes = torch.where(step > 0, (x - lo).div_(safe).round_(), 0).to(torch.uint8)
    return lo, step, codes


def _floats(payload: memoryview, at: int, count: int, what: str) -> np.ndarray:
    """``count`` float32 fields of ``payload`` at byte ``at``, checked finite (a read-only view)."""
    if at + 4 * count > len(payload):
        raise ValueError(f"coded payload: {what} past its end")
    got = np.frombuffer(payload, np.float32, count, at)
    if not np.isfinite(got).all():
        raise ValueError(f"coded payload: a channel's {what} is not finite")
    return got


_NATIVE: list[Any] = []       # the extension's dequantize or None, once looked up


def _native() -> Any:
    """The extension's one-pass ``dequantize`` (``cuda_ext/dequantize.cpp``) when the built
    extension is loaded (``radixkv.core.ops.backend()``, asked once), else ``None``: the
    numpy/torch path."""
    if not _NATIVE:
        from radixkv.core import ops

        _NATIVE.append(torch.ops.radixkv.dequantize if ops.backend() != "torch" else None)
    return _NATIVE[0]


#: One layer's parsed fields: its codes (uint8 as ``_pack`` made them, or plain for 8 bits), their
#: bits, the step (float32 ``[sides, heads * dim]``) and the reference with the codes' bias folded
#: in (float32 ``[sides, rows, heads * dim]``: one row for all tokens, or one per group of tokens).
_Layer = tuple[np.ndarray, int, np.ndarray, np.ndarray]

# The codes are read-only views of the payload (the kernel and the copies only read them).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)


def _readonly(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of an array that is only read (a view of a read-only blob, e.g. a
    peer's frame): torch's warning that it cannot protect such an array is silenced.  O(1)."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(array)


def _write(shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor | None, layers: list[_Layer],
           group: int) -> torch.Tensor:
    """The second half of a lossy decode, once everything is parsed and checked: per layer
    ``value = code * step + reference`` (the reference per ``group`` tokens), written into ``out``
    (a new CPU tensor without it; through one CPU tensor for another device).  With the built
    extension one pass a layer; else unpacked, then computed in float32 a layer at a time (it
    stays in cache) and rounded.  Both give the same bits."""
    _, sides, tokens, heads, dim = shape
    target = out if out is not None and out.device.type == "cpu" else torch.empty(shape, dtype=dtype)
    rows = -(-tokens // group)
    native = _native()
    if native is not None:
        # 16-bit KV goes through float32 and torch's cast (runtime-dispatched to the CPU's vector
        # instructions: several times the kernel's scalar rounding); float32 is written at once.
        staged = torch.empty(shape[1:], dtype=torch.float32) if dtype != torch.float32 else None
        for i, (packed, bits, step, reference) in enumerate(layers):
            native(_readonly(packed), bits, _readonly(step), _readonly(reference), group,
                   target[i] if staged is None else staged)
            if staged is not None:
                target[i].copy_(staged)
    else:
        scratch = torch.empty((sides, rows, group, heads, dim), dtype=torch.float32)
        body = scratch.view(sides, rows * group, heads, dim)[:, :tokens]
        count = sides * tokens * heads * dim
        for i, (packed, bits, step, reference) in enumerate(layers):
            codes = packed if bits == 8 else _unpack(packed, bits, count)
            np.copyto(body.numpy(), codes.reshape(sides, tokens, heads, dim), casting="unsafe")
            body.mul_(torch.from_numpy(step).view(sides, 1, heads, dim))
            scratch.add_(torch.from_numpy(reference).view(sides, rows, 1, heads, dim))
            target[i].copy_(body)
    if out is not None and target is not out:
        out.copy_(target)
        return out
    return target


class _Int8(Codec):
    """Lossy: per-channel asymmetric uint8 over the chunk's tokens.  Payload: per layer, its
    channels' minima and steps (float32, ``[sides, heads, head_dim]`` each), then its codes
    (uint8, ``[sides, tokens, heads, head_dim]``)."""

    name, code, lossy = "int8", 2, True

    def encode(self, kv: torch.Tensor) -> tuple[int, bytes] | None:
        if kv.dtype not in _FLOATS or not kv.numel():
            return None
        parts: list[bytes] = []
        for layer in _values(kv):
            x = layer.float()
            if not bool(torch.isfinite(x).all()):
                return None
            lo, step, codes = _quantize_minmax(x, 1)
            parts += (lo.numpy().tobytes(), step.numpy().tobytes(), codes.numpy().tobytes())
        return 8, b"".join(parts)

    def decode(self, payload: memoryview, param: int, dtype: torch.dtype, shape: tuple[int, ...],
               out: torch.Tensor | None) -> torch.Tensor:
        if param != 8 or dtype not in _FLOATS:
            raise ValueError(f"int8 codec: parameter {param} or dtype {dtype} not one it writes")
        layers, sides, tokens, heads, dim = shape
        channels = sides * heads * dim
        per_layer = 8 * channels + channels * tokens
        if len(payload) != layers * per_layer:
            raise ValueError(f"int8 codec: payload of {len(payload)} bytes, expected {layers * per_layer}")
        parsed: list[_Layer] = []
        for i in range(layers):
            at = i * per_layer
            lo = _floats(payload, at, channels, "minimum").reshape(sides, 1, heads * dim)
            step = _floats(payload, at + 4 * channels, channels, "step").reshape(sides, heads * dim)
            if (step < 0).any():
                raise ValueError("int8 codec: a negative step")
            codes = np.frombuffer(payload, np.uint8, channels * tokens, at + 8 * channels)
            parsed.append((codes, 8, step, lo))
        return _write(shape, dtype, out, parsed, tokens)


def layer_bits(base: int, num_layers: int) -> tuple[int, ...]:
    """Bits per layer for cachegen at ``base`` bits: the first third of the layers ``base + 2``,
    the second ``base + 1``, the rest ``base`` (earlier layers are the more sensitive).  O(layers).

    >>> layer_bits(3, 6)
    (5, 5, 4, 4, 3, 3)
    """
    return tuple(base + 2 - min(2, 3 * i // max(num_layers, 1)) for i in range(num_layers))


_MODE_MID, _MODE_ANCHOR = 0, 1
_FRAME_LEN = np.dtype("<u4")


def _split(values: np.ndarray, parts: int, width: int) -> np.ndarray:
    """Pack ``values`` (uint8, each below ``2**width``) ``parts`` to a byte: the i-th of each
    byte's fields from the i-th contiguous run of ``values`` (runs, so that unpacking writes whole
    runs instead of strided elements)."""
    run = -(-values.size // parts)
    padded = np.zeros(parts * run, np.uint8)
    padded[:values.size] = values
    out = padded[:run].copy()
    for i in range(1, parts):
        out |= padded[i * run:(i + 1) * run] << (width * i)
    return out


def _join(packed: np.ndarray, parts: int, width: int, out: np.ndarray) -> None:
    """Unpack what ``_split`` made into ``out`` (uint8, ``parts * packed.size`` long)."""
    run, mask = packed.size, (1 << width) - 1
    for i in range(parts - 1):
        np.bitwise_and(packed >> (width * i) if i else packed, mask, out=out[i * run:(i + 1) * run])
    np.right_shift(packed, width * (parts - 1), out=out[(parts - 1) * run:])     # the top field needs no mask


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """A layer's int8 codes (``|code| < 2**(bits - 1)``) as the bytes its frame compresses: each
    code biased to ``v = code + 2**(bits - 1)``, its low four bits two to a byte, and for 5 or 6
    bits its high bits four to a byte after them.  Packing also makes the frame decode about three
    times faster than one code a byte (fewer symbols for zstd's Huffman stage)."""
    biased = (codes.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    low = _split(biased & 15, 2, 4)
    return low if bits <= 4 else np.concatenate((low, _split(biased >> 4, 4, 2)))


def _packed_size(bits: int, count: int) -> int:
    return -(-count // 2) + (0 if bits <= 4 else -(-count // 4))


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The ``count`` biased codes (uint8, ``code + 2**(bits - 1)``) ``_pack`` made ``packed`` of."""
    low_run = -(-count // 2)
    values = np.empty(2 * low_run, np.uint8)
    _join(packed[:low_run], 2, 4, values)
    if bits > 4:
        high = np.empty(4 * (packed.size - low_run), np.uint8)
        _join(packed[low_run:], 4, 2, high)
        high[:count] <<= 4
        values[:count] |= high[:count]
    return values[:count]


class _CacheGen(Codec):
    """Lossy, CacheGen-class: delta to anchors, per-layer bits, zstd.  Payload, per layer: its
    bits (one byte), then per side its mode (one byte) and its reference — mode 0: the channels'
    midpoints (float32 ``[heads, head_dim]``); mode 1: the anchors' minima and steps (float32)
    and 8-bit codes (``[groups, heads, head_dim]``) —, then the sides' delta steps (float32,
    ``[sides, heads, head_dim]``), the byte length of the codes' zstd frame (uint32) and the frame
    (int8 codes ``[sides, tokens, heads, head_dim]``)."""

    name, code, lossy, entropy_coded = "cachegen", 3, True, True

    def __init__(self, bits: int = 3) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 4:
            raise ValueError(f"bits must be an int in 2..4 (the last layers'; earlier ones get up to 2 more), "
                             f"got {bits!r}")
        self.bits = bits

    def __repr__(self) -> str:
        return f"Codec(cachegen, bits={self.bits})"

    @property
    def key(self) -> tuple[int, int]:
        return (self.code, self.bits)

    def wrote(self, code: int, param: int) -> bool:
        return code == self.code and param == self.bits

    def encode(self, kv: torch.Tensor) -> tuple[int, bytes] | None:
        if kv.dtype not in _FLOATS or not kv.numel():
            return None
        values = _values(kv)
        layers, sides, tokens, heads, dim = values.shape
        compress = _zstd().ZstdCompressor(level=_ZSTD_LEVEL).compress
        parts: list[bytes] = []
        for bits, layer in zip(layer_bits(self.bits, layers), values):
            x = layer.float()                                                  # [sides, tokens, heads, dim]
            if not bool(torch.isfinite(x).all()):
                return None
            parts.append(bytes((bits,)))
            deltas = []
            for side in x:                                                     # [tokens, heads, dim]
                # The reference: the groups' first tokens (as a reader dequantises them) or the
                # channels' midpoints, whichever leaves the smaller deltas.
                a_lo, a_step, a_codes = _quantize_minmax(side[::_GROUP], 0)
                anchor = (a_codes.float() * a_step + a_lo).repeat_interleave(_GROUP, dim=0)[:tokens]
                mid = (side.amax(dim=0) + side.amin(dim=0)) / 2
                by_anchor, by_mid = side - anchor, side - mid
                if by_anchor.abs().amax(dim=0).sum() < by_mid.abs().amax(dim=0).sum():
                    parts += (bytes((_MODE_ANCHOR,)), a_lo.numpy().tobytes(), a_step.numpy().tobytes(),
                              a_codes.numpy().tobytes())
                    deltas.append(by_anchor)
                else:
                    parts += (bytes((_MODE_MID,)), mid.numpy().tobytes())
                    deltas.append(by_mid)
            delta = torch.stack(deltas)
            step = delta.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1)
            codes = torch.where(step > 0, delta.div_(torch.where(step > 0, step, 1)).round_(), 0).to(torch.int8)
            frame = compress(_pack(codes.numpy().reshape(-1), bits).data)
            parts += (step.numpy().tobytes(), np.array([len(frame)], _FRAME_LEN).tobytes(), frame)
        return self.bits, b"".join(parts)

    def decode(self, payload: memoryview, param: int, dtype: torch.dtype, shape: tuple[int, ...],
               out: torch.Tensor | None) -> torch.Tensor:
        if not 2 <= param <= 4 or dtype not in _FLOATS:
            raise ValueError(f"cachegen codec: parameter {param} or dtype {dtype} not one it writes")
        layers, sides, tokens, heads, dim = shape
        groups, channels = -(-tokens // _GROUP), heads * dim
        parsed: list[_Layer] = []
        decompressor = _zstd().ZstdDecompressor()
        count = sides * tokens * channels
        at = 0
        for i, bits in enumerate(layer_bits(param, layers)):
            if at >= len(payload) or payload[at] != bits:
                raise ValueError(f"cachegen codec: layer {i}'s bits are not {bits}")
            at += 1
            references = []
            for _ in range(sides):
                if at >= len(payload) or payload[at] not in (_MODE_MID, _MODE_ANCHOR):
                    raise ValueError(f"cachegen codec: layer {i}: an unknown reference mode")
                mode, at = payload[at], at + 1
                if mode == _MODE_MID:
                    references.append(_floats(payload, at, channels, "midpoint")[None])
                    at += 4 * channels
                    continue
                a_lo = _floats(payload, at, channels, "anchor minimum")
                a_step = _floats(payload, at + 4 * channels, channels, "anchor step")
                at += 8 * channels
                if at + groups * channels > len(payload):
                    raise ValueError("cachegen codec: anchor codes past the payload's end")
                a_codes = np.frombuffer(payload, np.uint8, groups * channels, at).reshape(groups, channels)
                at += groups * channels
                references.append(a_codes * a_step + a_lo)        # float32, as the encoder computed it
            step = _floats(payload, at, sides * channels, "step").reshape(sides, channels)
            at += 4 * sides * channels
            if at + 4 > len(payload):
                raise ValueError("cachegen codec: a frame length past the payload's end")
            frame_len = int(np.frombuffer(payload, _FRAME_LEN, 1, at)[0])
            at += 4
            if at + frame_len > len(payload):
                raise ValueError("cachegen codec: a frame past the payload's end")
            data = _decompress(payload[at:at + frame_len], _packed_size(bits, count), decompressor)
            at += frame_len
            # value = (biased - bias) * step + reference = biased * step + (reference - bias * step)
            bias = np.float32(1 << (bits - 1))
            reference = np.empty((sides, groups, channels), np.float32)
            for side, ref in enumerate(references):
                reference[side] = ref - bias * step[side]
            parsed.append((np.frombuffer(data, np.uint8), bits, step, reference))
        if at != len(payload):
            raise ValueError(f"cachegen codec: {len(payload) - at} stray bytes after the last layer")
        return _write(shape, dtype, out, parsed, _GROUP)


#: The codecs by name (``cachegen`` at its default 3 bits for the last layers).
CODECS: dict[str, Codec] = {c.name: c for c in (Codec(), _Zstd(), _Int8(), _CacheGen())}
_BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values()}


def get_codec(name: str | Codec | None) -> Codec:
    """The codec called ``name`` (``None``: ``none``; ``cachegen:B``: cachegen with ``B`` bits for
    the last layers, 2 to 4); a ``Codec`` is returned as it is.  ``ValueError`` names the codecs
    for an unknown name.  O(1).

    >>> get_codec("int8").lossy, get_codec(None).name, get_codec("cachegen:4").bits
    (True, 'none', 4)
    """
    if name is None:
        return CODECS["none"]
    if isinstance(name, Codec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"codec must be a codec name or None, got {type(name).__name__}")
    if name in CODECS:
        return CODECS[name]
    base, _, bits = name.partition(":")
    if base == "cachegen" and bits.isdigit() and 2 <= int(bits) <= 4:
        return _CacheGen(int(bits))
    raise ValueError(f"codec must be one of {sorted(CODECS)} (or cachegen:BITS, BITS 2 to 4), got {name!r}")


def codec_by_code(code: int) -> Codec:
    """The codec of a chunk header's code; ``ValueError`` for a code this version does not know
    (a chunk from a newer writer: a miss).  O(1)."""
    try:
        return _BY_CODE[code]
    except KeyError:
        raise ValueError(f"chunk codec {code} unknown to this version") from None


def lossy_code(code: int) -> bool:
    """Whether chunks of header codec ``code`` hold approximate KV.  O(1)."""
    codec = _BY_CODE.get(code)
    return codec is not None and codec.lossy

