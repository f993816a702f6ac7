"""`pdserve convert` on corrupt or hostile input (`tooling.models.gguf_input`): a truncated file,
impossible counts, flipped metadata bytes, an `--out` that cannot be written and weights
holding NaN or Inf each end in one line on stderr and exit status 2, with nothing written.

The files are the tiny random model written as GGUF by `tooling.models.gguf_write`, then
damaged byte by byte here.
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import gguf
import pytest

from deploy.cli import main
from tooling.models.gguf_write import hf_to_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_to_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")


def _convert(
    src: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, str]:
    code = main(["convert", "--gguf", str(src), "--out", str(out), *extra])
    return code, capsys.readouterr().err


def _refused(code: int, err: str, out: Path, *words: str) -> None:
    """Exit 2, one line on stderr naming `words`, no traceback, nothing at `out`."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve convert: "), err
    for w in words:
        assert w in lines[0], err
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*.partial"))


def test_truncated_file(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:200])
    out = tmp_path / "out"
    _refused(*_convert(bad, out, capsys), out, "corrupt or truncated")


@pytest.mark.parametrize("offset", [8, 16], ids=["tensor_count", "kv_count"])
def test_a_count_of_2_to_the_40(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], offset: int
) -> None:
    raw = bytearray(tiny_gguf.read_bytes())
    raw[offset : offset + 8] = struct.pack("<Q", 1 << 40)
    bad = tmp_path / "count.gguf"
    bad.write_bytes(bytes(raw))
    out = tmp_path / "out"
    _refused(*_convert(bad, out, capsys), out, str(1 << 40), "cannot fit")


def test_flipped_metadata_bytes(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Random bytes anywhere in the header (key-value metadata and tensor infos): each file
    converts, or is refused in one line; never a traceback. Seeded, so a failure replays."""
    raw = tiny_gguf.read_bytes()
    end = gguf.GGUFReader(str(tiny_gguf)).data_offset
    rng = random.Random(39)
    refused = 0
    for case in range(40):
        data = bytearray(raw)
        for _ in range(rng.choice([1, 2, 4])):
            data[rng.randrange(24, end)] = rng.randrange(256)
        bad = tmp_path / f"flip{case}.gguf"
        bad.write_bytes(bytes(data))
        out = tmp_path / f"out{case}"
        code, err = _convert(bad, out, capsys)
        if code == 0:
            assert (out / "model.safetensors").is_file()
            continue
        _refused(code, err, out)
        refused += 1
    assert refused >= 20, f"only {refused} of 40 damaged files were refused"


def test_out_under_a_file(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "model"
    code, err = _convert(tiny_gguf, out, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out {out}: cannot write there" in err
    assert blocker.read_text() == "not a folder"


def test_out_in_a_read_only_place(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder without write permission (as root, which ignores permissions: /sys, which
    refuses new entries to everyone)."""
    if os.geteuid() != 0:
        parent = tmp_path / "read-only"
        parent.mkdir()
        parent.chmod(0o500)
    else:
        parent = Path("/sys")
        if not parent.is_dir():
            pytest.skip("root without /sys: no place here refuses writes to root")
    out = parent / "pdserve-model"
    try:
        code, err = _convert(tiny_gguf, out, capsys)
    finally:
        if parent != Path("/sys"):
            parent.chmod(0o700)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out {out}: cannot write there" in err
    assert not out.exists()


def _with_value(src: Path, dst: Path, tensor: str, value: float) -> None:
    """Copy of the F32 file `src` with the first element of `tensor` set to `value`."""
    reader = gguf.GGUFReader(str(src))
    (t,) = [t for t in reader.tensors if t.name == tensor]
    raw = bytearray(src.read_bytes())
    raw[t.data_offset : t.data_offset + 4] = struct.pack("<f", value)
    dst.write_bytes(bytes(raw))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_unless_allowed(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float
) -> None:
    bad = tmp_path / "nan.gguf"
    _with_value(tiny_gguf, bad, "blk.0.ffn_down.weight", value)
    out = tmp_path / "out"
    _refused(*_convert(bad, out, capsys), out, "'blk.0.ffn_down.weight'", "--allow-non-finite")
    code, err = _convert(bad, out, capsys, "--allow-non-finite")
    assert code == 0, err
    assert (out / "model.safetensors").is_file()
