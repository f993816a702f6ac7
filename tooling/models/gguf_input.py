"""Reading a GGUF file that may be corrupt: the header, the metadata values and the tensors'
shapes and values are checked before the converter trusts them.

Runs in the CLI process (`pdserve convert`, `pdserve pull`) and in tests. The `gguf` package's
reader trusts the file: a count that runs past the end, a string that is not UTF-8 or a
truncated tensor surface as whatever numpy or the codec raises (IndexError, KeyError, ...).
Here every such failure becomes a `GGUFConversionError` (a ValueError) naming the file and what
is wrong, so `pdserve convert` prints one line and exits 2:

- `open_gguf`: the 24-byte header first (magic, version, and tensor / key-value counts that
  could fit in the file's size: a count of 2^40 in a 10 MB file is refused before any loop),
  then the reader, each of its failures on a corrupt file named as such;
- `read_metadata`: every key decoded, a value that does not decode named by its key;
- `count`, `positive_float`, `token_id`: metadata numbers in range, named by key;
- `check_shapes`: every tensor's shape is the one the config implies (a flipped dimension is
  caught here, not as a reshape error deep inside the conversion);
- `check_finite`: a tensor holding NaN or Inf is refused unless the caller allows it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_HEADER = 24  # magic, u32 version, u64 tensor count, u64 key-value count
# The fewest bytes one entry can take: a key-value pair is a u64 key length, a u32 type and a
# one-byte value; a tensor's info is a u64 name length, a u32 rank, a u32 type and a u64 offset.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8
# The largest count a metadata dimension may hold (layers, heads, widths, context): far above
# any real model, far below what would make the converter loop or allocate for ever.
MAX_COUNT = 1 << 24


class GGUFConversionError(ValueError):
    """The file cannot be converted; the message names the field or tensor and the value."""


def _header_counts(path: Path, size: int) -> None:
    """Refuse a file too short for a header, with a wrong magic, or whose tensor and
    key-value counts cannot fit in its `size` bytes (module docstring)."""
    with path.open("rb") as f:
        head = f.read(_HEADER)
    if len(head) < _HEADER or head[:4] != _MAGIC:
        raise GGUFConversionError(f"{path}: not a GGUF file (no GGUF header)")
    # The reader's own byte-order rule: a version whose low 16 bits are 0 was written swapped.
    order = ">" if struct.unpack("<I", head[4:8])[0] & 0xFFFF == 0 else "<"
    tensors, kvs = struct.unpack(order + "QQ", head[8:24])
    room = size - _HEADER
    if tensors * _MIN_TENSOR_BYTES + kvs * _MIN_KV_BYTES > room:
        raise GGUFConversionError(
            f"{path}: GGUF header counts {tensors} tensors and {kvs} metadata keys, which "
            f"cannot fit in its {size} bytes (the file is corrupt or truncated)"
        )


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over `path`, or `GGUFConversionError` saying why the file is not a
    readable GGUF file."""
    import gguf

    if not path.is_file():
        raise GGUFConversionError(f"{path}: no such file")
    try:
        size = path.stat().st_size
        _header_counts(path, size)
        return gguf.GGUFReader(str(path))
    except GGUFConversionError:
        raise
    except OSError as exc:
        raise GGUFConversionError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    # What the reader raises on a corrupt file: a read past the end (IndexError), a duplicated
    # key (KeyError), a bad value (ValueError, UnicodeDecodeError), a size that overflows.
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError) as exc:
        raise GGUFConversionError(
            f"{path}: not a readable GGUF file (corrupt or truncated): {type(exc).__name__}: {exc}"
        ) from exc


def read_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """Every key-value field of the file, decoded (strings, numbers, lists); a value that does
    not decode is named by its key."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except (ValueError, IndexError, TypeError) as exc:
            raise GGUFConversionError(
                f"{path}: GGUF metadata {key!r} does not decode (corrupt file): {exc}"
            ) from exc
    return out


def count(meta: dict[str, Any], key: str, default: int | None = None, least: int = 1) -> int:
    """The metadata integer `key` (or `default` when absent), `least` <= value <= `MAX_COUNT`."""
    value = meta.get(key, default)
    if value is None:
        raise GGUFConversionError(f"GGUF metadata: required key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GGUFConversionError(f"GGUF {key}={value!r} is not an integer")
    if not least <= int(value) <= MAX_COUNT:
        raise GGUFConversionError(f"GGUF {key}={int(value)} is out of range {least}..{MAX_COUNT}")
    return int(value)


def positive_float(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    """The metadata number `key` (or `default` when absent): finite and > 0."""
    value = meta.get(key, default)
    if value is None:
        raise GGUFConversionError(f"GGUF metadata: required key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise GGUFConversionError(f"GGUF {key}={value!r} is not a number")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise GGUFConversionError(f"GGUF {key}={float(value)} must be finite and > 0")
    return float(value)


def token_id(meta: dict[str, Any], key: str, vocab: int) -> int | None:
    """The special-token id `key` (None when absent): an integer in 0..vocab-1."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GGUFConversionError(f"GGUF {key}={value!r} is not an integer")
    if not 0 <= int(value) < vocab:
        raise GGUFConversionError(f"GGUF {key}={int(value)} is not a token id (0..{vocab - 1})")
    return int(value)


_LAYER_SHAPES = {  # HF name inside a layer -> (rows, cols) in config terms
    "input_layernorm": ("hidden",),
    "post_attention_layernorm": ("hidden",),
    "self_attn.q_proj": ("q", "hidden"),
    "self_attn.k_proj": ("kv", "hidden"),
    "self_attn.v_proj": ("kv", "hidden"),
    "self_attn.o_proj": ("hidden", "q"),
    "mlp.gate_proj": ("inter", "hidden"),
    "mlp.up_proj": ("inter", "hidden"),
    "mlp.down_proj": ("hidden", "inter"),
}
_TOP_SHAPES = {
    "model.embed_tokens.weight": ("vocab", "hidden"),
    "lm_head.weight": ("vocab", "hidden"),
    "model.norm.weight": ("hidden",),
}


def expected_shape(hf: str, config: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape `config` implies for the HF parameter `hf` of a llama model; None when no
    such parameter exists in a model of this config (a layer past its last)."""
    sizes = {
        "hidden": config["hidden_size"],
        "inter": config["intermediate_size"],
        "q": config["num_attention_heads"] * config["head_dim"],
        "kv": config["num_key_value_heads"] * config["head_dim"],
        "vocab": config["vocab_size"],
    }
    dims = _TOP_SHAPES.get(hf)
    parts = hf.split(".", 3)  # model, layers, N, rest
    in_layers = len(parts) == 4 and parts[1] == "layers" and parts[2].isdigit()
    if dims is None and in_layers and int(parts[2]) < config["num_hidden_layers"]:
        dims = _LAYER_SHAPES.get(parts[3].removesuffix(".weight"))
    return None if dims is None else tuple(sizes[d] for d in dims)


def check_shapes(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]], config: dict[str, Any]
) -> None:
    """Each `(gguf name, HF name, shape)` has the shape `config` implies for its HF name."""
    for name, hf, shape in tensors:
        expected = expected_shape(hf, config)
        if expected is None:
            raise GGUFConversionError(
                f"tensor {name!r} belongs to no layer of a {config['num_hidden_layers']}-layer "
                "model"
            )
        if shape != expected:
            raise GGUFConversionError(
                f"tensor {name!r} has shape {list(shape)}; the metadata implies "
                f"{list(expected)} (the file is corrupt or inconsistent)"
            )


def check_finite(name: str, values: np.ndarray, allow: bool) -> None:
    """Refuse a tensor holding NaN or Inf (unless `allow`): a model with such weights gives
    garbage or NaN logits, so converting it silently only moves the failure to serving."""
    if allow:
        return
    bad = values.size - int(np.count_nonzero(np.isfinite(values)))
    if bad:
        raise GGUFConversionError(
            f"tensor {name!r} holds {bad} non-finite values (NaN or Inf) of {values.size}; "
            "pass --allow-non-finite to convert it anyway"
        )
