"""Block copies (radixkv.core.ops): the C++ kernel against the torch reference, bit for bit, and the
reference against the plain per-page definition; argument checks; backend selection."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv import ops
from radixkv.core.pool import _POOL_DTYPES, KVLayout, KVPool

DTYPES = sorted(_POOL_DTYPES, key=str)
HAVE_CXX = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture(scope="module")
def cpp() -> None:
    """The C++ extension, built into its directory (or found built there) once for this module."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler on PATH: only the torch fallback can run here")
    assert ops.build() in ("cpp", "cuda+cpp")


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaNs included: the copies move bytes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, contiguous, of shape ``[*t.shape[:-1], t.shape[-1] * itemsize]``."""
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)  # standard strides, even for size-1 axes
    return dense.view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bytes hold NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


@st.composite
def copies(draw: st.DrawFn) -> dict:
    """A pool layout, page ids (distinct, so that they also serve a scatter), a skip and a buffer."""
    layers = draw(st.integers(1, 8))
    page_size = draw(st.integers(1, 32))
    heads = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([1, 3, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    num_pages = draw(st.integers(1, 12))
    ids = draw(st.lists(st.integers(0, num_pages - 1), max_size=num_pages, unique=True))
    skip = draw(st.integers(0, 3))
    extra = draw(st.integers(0, page_size + 1))  # tokens after the copied pages, left alone
    return dict(shape=(layers, 2, num_pages, page_size, heads, dim), dtype=dtype, ids=ids, skip=skip,
                tokens=(skip + len(ids)) * page_size + extra, seed=draw(st.integers(0, 2**31 - 1)))


def make(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"])
    layers, _, _, _, heads, dim = case["shape"]
    kv = random_bytes(case["shape"], case["dtype"], gen)
    buf = random_bytes((layers, 2, case["tokens"], heads, dim), case["dtype"], gen)
    return kv, buf


def gather_by_definition(kv: torch.Tensor, ids: list[int], buf: torch.Tensor, skip: int) -> torch.Tensor:
    """out[l, s, (skip+i)*ps : (skip+i+1)*ps] = kv[l, s, ids[i]], one page at a time, on bytes."""
    out, ps = as_bytes(buf).clone(), kv.shape[3]
    for i, page in enumerate(ids):
        out[:, :, (skip + i) * ps:(skip + i + 1) * ps] = as_bytes(kv)[:, :, page]
    return out


# ------------------------------------------------------------------------- exactness


@given(copies())
def test_torch_reference_matches_the_definition(case: dict) -> None:
    kv, buf = make(case)
    expected_out = gather_by_definition(kv, case["ids"], buf, case["skip"])
    ops._gather_torch(kv, torch.tensor(case["ids"], dtype=torch.int64), buf, case["skip"])
    assert torch.equal(as_bytes(buf), expected_out)

    kv, buf = make(case)
    expected_kv = as_bytes(kv).clone()
    for i, page in enumerate(case["ids"]):
        ps = kv.shape[3]
        expected_kv[:, :, page] = as_bytes(buf)[:, :, (case["skip"] + i) * ps:(case["skip"] + i + 1) * ps]
    ops._scatter_torch(buf, kv, torch.tensor(case["ids"], dtype=torch.int64), case["skip"])
    assert torch.equal(as_bytes(kv), expected_kv)


@given(copies())
def test_cpp_gather_is_bit_exact(cpp: None, case: dict) -> None:
    kv, buf = make(case)
    expected = buf.clone()
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._gather_torch(kv, ids, expected, case["skip"])
    torch.ops.radixkv.gather_pages(kv, ids, buf, case["skip"])
    assert torch.equal(as_bytes(buf), as_bytes(expected))


@given(copies())
def test_cpp_scatter_is_bit_exact(cpp: None, case: dict) -> None:
    kv, buf = make(case)
    expected = kv.clone()
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._scatter_torch(buf, expected, ids, case["skip"])
    torch.ops.radixkv.scatter_pages(buf, kv, ids, case["skip"])
    assert torch.equal(as_bytes(kv), as_bytes(expected))


def test_cpp_multithreaded_copy_is_exact(cpp: None) -> None:
    # 4 MiB with 32 KiB rows: large enough for the kernel to split the rows over threads.
    gen = torch.Generator().manual_seed(0)
    kv = random_bytes((8, 2, 40, 16, 8, 64), torch.float32, gen)
    ids = torch.randperm(40, generator=gen)[:16]
    out = torch.empty((8, 2, 16 * 16, 8, 64))
    ops.gather_pages(kv, ids, out)
    assert torch.equal(as_bytes(out.view(8, 2, 16, 16, 8, 64)), as_bytes(kv[:, :, ids]))
    kv2 = torch.zeros_like(kv)
    ops.scatter_pages(out, kv2, ids)
    assert torch.equal(as_bytes(kv2[:, :, ids]), as_bytes(kv[:, :, ids]))


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_public_ops_round_trip_through_a_kvpool(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.ENV_MODE, mode)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, page_size=4)
    pool = KVPool(layout, num_pages=8)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    src = pool.alloc(3)
    chunk = ops.gather_pages(pool, src, skip_pages=1)  # out=None: exactly (1 + 3) pages
    assert chunk.shape == layout.chunk_shape(16)
    dst = pool.alloc(3)
    ops.scatter_pages(chunk, pool, torch.as_tensor(dst), skip_pages=1)
    assert torch.equal(pool.kv[:, :, dst], pool.kv[:, :, src])


def test_skipped_and_trailing_tokens_are_left_alone() -> None:
    kv = torch.arange(1 * 2 * 4 * 2 * 1 * 1, dtype=torch.float32).view(1, 2, 4, 2, 1, 1)
    out = torch.full((1, 2, 8, 1, 1), -1.0)
    ops.gather_pages(kv, [3, 0], out, skip_pages=1)
    assert out[0, 0, :, 0, 0].tolist() == [-1, -1, 6, 7, 0, 1, -1, -1]
    assert out[0, 1, :, 0, 0].tolist() == [-1, -1, 14, 15, 8, 9, -1, -1]


def test_empty_page_ids_move_nothing() -> None:
    kv = torch.ones(1, 2, 3, 2, 1, 1)
    out = torch.zeros(1, 2, 0, 1, 1)
    assert ops.gather_pages(kv, [], out) is out
    ops.scatter_pages(out, kv, np.array([], dtype=np.int64))
    assert torch.equal(kv, torch.ones(1, 2, 3, 2, 1, 1))


# ------------------------------------------------------------------------ bad input

KV = torch.zeros(2, 2, 4, 2, 3, 5)
BUF = torch.zeros(2, 2, 4, 3, 5)

BAD_GATHER = [
    # (pool, page_ids, out, skip_pages), error, words the message must contain
    ((KV, [0], BUF, "1"), TypeError, "skip_pages"),
    ((KV, [0], BUF, -1), ValueError, "skip_pages"),
    ((KV, [0], BUF, 2), ValueError, "out holds 4 tokens"),
    ((KV, [0, 4], BUF, 0), ValueError, "page_ids holds page id 4"),
    ((KV, [-1], BUF, 0), ValueError, "page_ids"),
    ((KV, [0.5], BUF, 0), TypeError, "page_ids"),
    ((KV, [[0]], BUF, 0), ValueError, "page_ids must be 1-D"),
    ((KV, [0], BUF.half(), 0), TypeError, "out has dtype torch.float16"),
    ((KV, [0], torch.zeros(2, 2, 4, 3, 4), 0), ValueError, "out must be [2, 2, num_tokens, 3, 5]"),
    ((KV, [0], torch.zeros(2, 2, 4, 5, 3).transpose(3, 4), 0), ValueError, "out must be contiguous"),
    ((KV, [0], "buffer", 0), TypeError, "out must be a torch.Tensor"),
    ((KV[0], [0], BUF, 0), ValueError, "pool must be"),
    ((KV.transpose(0, 2), [0], BUF, 0), ValueError, "pool must be"),
    (([1, 2], [0], BUF, 0), TypeError, "pool must be a KVPool"),
    ((KV, [0], KV.view(2, 2, 8, 3, 5), 0), ValueError, "shares memory"),
]


def check_rejected(gather: Any, args: tuple, error: type, words: str) -> None:
    """``gather(source, ids, out, skip)`` raises ``error`` with ``words`` (a regex) and leaves ``out``."""
    source, ids, out, skip = args
    before = out.clone() if isinstance(out, torch.Tensor) else None
    with pytest.raises(error, match=words):
        gather(source, ids, out, skip)
    if before is not None:
        assert torch.equal(out, before)


@pytest.mark.parametrize("args, error, words", BAD_GATHER)
def test_gather_rejects_bad_arguments(args: tuple, error: type, words: str) -> None:
    check_rejected(lambda *a: ops.gather_pages(*a[:3], skip_pages=a[3]), args, error, words.replace("[", r"\["))


def test_scatter_rejects_repeated_pages_and_leaves_the_pool() -> None:
    kv = torch.zeros(2, 2, 4, 2, 3, 5)
    with pytest.raises(ValueError, match="page 1 more than once"):
        ops.scatter_pages(torch.ones(2, 2, 4, 3, 5), kv, [1, 1])
    with pytest.raises(ValueError, match="src holds 4 tokens"):
        ops.scatter_pages(torch.ones(2, 2, 4, 3, 5), kv, [1, 2, 3])
    assert not kv.any()


CPP_BAD = [
    # arguments straight to the C++ op, skipping the Python checks: an exception, never a crash
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([4]), BUF, 0), ValueError, "outside the pool"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([-1]), BUF, 0), ValueError, "outside the pool"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0], dtype=torch.int32), BUF, 0), TypeError,
     "int64"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([[0]]), BUF, 0), ValueError, "1-D"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0]), BUF, 2), ValueError, "holds 4 tokens: too few"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0]), BUF, -3), ValueError, "skip_pages"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0]), BUF, 2**62), ValueError, "holds 4 tokens"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0]), BUF.double(), 0), TypeError, "dtype"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0]), BUF[:, :, :, :, :4], 0), ValueError,
     "KV of the pool needs"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0]), BUF.transpose(0, 1), 0), ValueError,
     "contiguous"),
    (lambda: torch.ops.radixkv.gather_pages(KV[0], torch.tensor([0]), BUF, 0), ValueError, "6-D"),
    (lambda: torch.ops.radixkv.gather_pages(torch.cat([KV, KV], 1), torch.tensor([0]), BUF, 0), ValueError, "K and V"),
    (lambda: torch.ops.radixkv.gather_pages(KV, torch.tensor([0]), KV.view(2, 2, 8, 3, 5), 0), ValueError,
     "share memory"),
    (lambda: torch.ops.radixkv.scatter_pages(BUF, KV, torch.tensor([2, 2]), 0), ValueError, "more than once"),
    (lambda: torch.ops.radixkv.scatter_pages(BUF, KV, torch.tensor([9]), 0), ValueError, "outside the pool"),
]


@pytest.mark.parametrize("call, error, words", CPP_BAD)
def test_cpp_op_rejects_bad_arguments(cpp: None, call, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        call()


# -------------------------------------------------------------------- backend choice


def test_backend_off_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.ENV_MODE, "off")
    assert ops.backend() == "torch"


def test_backend_rejects_an_unknown_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.ENV_MODE, "sometimes")
    with pytest.raises(ValueError, match="RADIXKV_EXT"):
        ops.backend()


def _no_build() -> str:
    raise ops._ext.BuildMissing("the block-copy extension is not built (no build in /nowhere)")


def test_a_missing_build_warns_once_under_auto_and_raises_under_require(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "_outcome", None)
    monkeypatch.setattr(ops._ext, "load", _no_build)
    monkeypatch.setenv(ops.ENV_MODE, "auto")
    with pytest.warns(RuntimeWarning, match="not built .* torch kernels"):
        assert ops.backend() == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.backend() == "torch"  # the outcome is kept: no second look, no second warning
        out = ops.gather_pages(torch.ones(1, 2, 2, 1, 1, 1), [1], torch.zeros(1, 2, 1, 1, 1))
        assert out.sum() == 2
    monkeypatch.setenv(ops.ENV_MODE, "require")
    with pytest.raises(RuntimeError, match="RADIXKV_EXT=require, but the block-copy extension is not built"):
        ops.backend()


def test_cpp_kernels_are_loaded_from_the_keyed_directory(cpp: None) -> None:
    assert (ops.extension_dir() / ops._ext.MANIFEST).is_file()
    assert ops.extension_dir().name == ops._ext.build_key()


def test_sources_are_all_shipped_as_package_data() -> None:
    # setup.cfg ships radixkv.cuda_ext's *.cpp, *.cu, *.h, *.cuh: a source of another kind would be
    # missing from a wheel, and the build from an installed package would fail.
    src = ops._ext.sources_dir()
    assert (src / "block_copy.cpp").is_file()
    shipped = {".cpp", ".cu", ".h", ".cuh"}
    assert all(p.suffix in shipped or p.name == "__init__.py" for p in src.iterdir() if p.is_file()), \
        sorted(p.name for p in src.iterdir())


@pytest.mark.slow                 # a benchmark run (seconds): `make test` runs it
def test_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from radixkv.bench import block_copy as copy

    out = tmp_path / "copy.txt"
    assert copy.main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# python -m radixkv.bench copy --quick")
    assert "gather / cold memcpy read" in text and "per-page loop" in text


# ------------------------------------------------------- an engine's own layers (gather_blocks)

# How an engine may lay out one layer's KV, each given as the 5-D view [sides, num_blocks,
# block_size, heads, head_dim] that gather_blocks takes.  "cross-layer" puts every layer in one
# tensor [num_blocks, num_layers, sides, ...], so that the layers interleave in one storage.
LAYOUTS = ["sbthd", "bsthd", "sbhtd", "cross-layer", "padded", "dim-strided", "mla"]


def engine_layers(layout: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
                  device: str = "cpu") -> list[torch.Tensor]:
    """Random per-layer tensors of ``layout`` on ``device``, as 5-D views of logical ``shape`` = (L, sides, nb,
    bs, H, D)."""
    layers, sides, nb, bs, heads, dim = shape

    def alloc(*dims: int) -> torch.Tensor:
        return random_bytes(dims, dtype, gen).to(device)

    if layout == "cross-layer":
        whole = alloc(nb, layers, sides, bs, heads, dim)
        return [whole[:, l].transpose(0, 1) for l in range(layers)]
    views = {
        "sbthd": lambda: alloc(sides, nb, bs, heads, dim),  # vLLM's FlashAttention / CPU layout [2, nb, bs, H, D]
        "bsthd": lambda: alloc(nb, sides, bs, heads, dim).transpose(0, 1),  # [nb, 2, bs, H, D] (FlashInfer)
        "sbhtd": lambda: alloc(sides, nb, heads, bs, dim).transpose(2, 3),  # [2, nb, H, bs, D]
        "padded": lambda: alloc(sides, nb, bs, heads, dim + 3)[..., 1:dim + 1],  # rows not contiguous
        "dim-strided": lambda: alloc(sides, nb, bs, dim, heads).transpose(3, 4),  # element-wise strides
        "mla": lambda: alloc(nb, bs, dim).unsqueeze(0).unsqueeze(3),  # [nb, bs, D]: one side, one head
    }
    return [views[layout]() for _ in range(layers)]


@st.composite
def block_copies(draw: st.DrawFn) -> dict:
    layout = draw(st.sampled_from(LAYOUTS))
    sides, heads = (1, 1) if layout == "mla" else (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    num_blocks = draw(st.integers(1, 10))
    block_size = draw(st.integers(1, 16))
    ids = draw(st.lists(st.integers(0, num_blocks - 1), max_size=num_blocks, unique=True))
    skip = draw(st.integers(0, 3))
    return dict(layout=layout, shape=(draw(st.integers(1, 5)), sides, num_blocks, block_size, heads,
                                      draw(st.sampled_from([1, 3, 8]))),
                dtype=draw(st.sampled_from(DTYPES)), ids=ids, skip=skip,
                tokens=(skip + len(ids)) * block_size + draw(st.integers(0, block_size + 1)),
                seed=draw(st.integers(0, 2**31 - 1)))


def make_blocks(case: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"])
    layers = engine_layers(case["layout"], case["shape"], case["dtype"], gen)
    num_layers, sides, _, _, heads, dim = case["shape"]
    return layers, random_bytes((num_layers, sides, case["tokens"], heads, dim), case["dtype"], gen)


def gather_blocks_by_definition(layers: list[torch.Tensor], ids: list[int], buf: torch.Tensor,
                                skip: int) -> torch.Tensor:
    """out[l, s, (skip+i)*bs + t] = layers[l][s, ids[i], t], one block at a time, on bytes."""
    out, bs = as_bytes(buf).clone(), layers[0].shape[2]
    for l, layer in enumerate(layers):
        for i, block in enumerate(ids):
            out[l, :, (skip + i) * bs:(skip + i + 1) * bs] = as_bytes(layer[:, block])
    return out


def scatter_blocks_by_definition(src: torch.Tensor, layers: list[torch.Tensor], ids: list[int],
                                 skip: int) -> list[torch.Tensor]:
    """The bytes each layer should hold after the scatter (as contiguous copies)."""
    bs, expected = layers[0].shape[2], [as_bytes(t).clone() for t in layers]
    for l in range(len(layers)):
        for i, block in enumerate(ids):
            expected[l][:, block] = as_bytes(src[l, :, (skip + i) * bs:(skip + i + 1) * bs])
    return expected


@given(block_copies())
def test_torch_block_reference_matches_the_definition(case: dict) -> None:
    layers, buf = make_blocks(case)
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    expected_out = gather_blocks_by_definition(layers, case["ids"], buf, case["skip"])
    ops._gather_torch(layers, ids, buf, case["skip"])
    assert torch.equal(as_bytes(buf), expected_out)

    layers, buf = make_blocks(case)
    expected = scatter_blocks_by_definition(buf, layers, case["ids"], case["skip"])
    ops._scatter_torch(buf, layers, ids, case["skip"])
    assert all(torch.equal(as_bytes(t), e) for t, e in zip(layers, expected))


@pytest.mark.parametrize("mode", ["auto", "off"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_public_block_ops_round_trip(mode: str, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.ENV_MODE, mode)
    gen = torch.Generator().manual_seed(1)
    shape = (3, 1, 7, 4, 1, 8) if layout == "mla" else (3, 2, 7, 4, 2, 8)
    layers = engine_layers(layout, shape, torch.float16, gen)
    before = [t.clone() for t in layers]
    chunk = torch.zeros((3, shape[1], 5 * 4, shape[4], 8), dtype=torch.float16)
    assert ops.gather_blocks(layers, [6, 0, 3], chunk, skip_blocks=2) is chunk
    assert not chunk[:, :, :8].any()
    for l in range(3):
        assert same(chunk[l, :, 8:].view(shape[1], 3, 4, shape[4], 8), layers[l][:, [6, 0, 3]])
    ops.scatter_blocks(chunk, layers, torch.tensor([1, 2, 5]), skip_blocks=2)
    for l in range(3):
        assert same(layers[l][:, [1, 2, 5]], before[l][:, [6, 0, 3]])
        assert same(layers[l][:, [0, 3, 4, 6]], before[l][:, [0, 3, 4, 6]])  # the rest untouched


def test_pool_ops_are_the_block_ops_on_the_pool_layers() -> None:
    gen = torch.Generator().manual_seed(2)
    kv = random_bytes((3, 2, 6, 4, 2, 8), torch.bfloat16, gen)
    a, b = torch.zeros(3, 2, 12, 2, 8, dtype=torch.bfloat16), torch.ones(3, 2, 12, 2, 8, dtype=torch.bfloat16)
    ops.gather_pages(kv, [5, 2], a, skip_pages=1)
    ops.gather_blocks(list(kv.unbind(0)), [5, 2], b, skip_blocks=1)
    assert same(a[:, :, 4:], b[:, :, 4:])


BL = [torch.zeros(2, 4, 2, 3, 5) for _ in range(2)]
BAD_BLOCK_GATHER = [
    # (layers, block_ids, out, skip_blocks), error, words the message must contain
    ((BL, [0], BUF, "1"), TypeError, "skip_blocks must be an int"),
    ((BL, [0], BUF, -1), ValueError, "skip_blocks must be >= 0"),
    ((BL, [0], BUF, 2), ValueError, "out holds 4 tokens, but skip_blocks=2 plus 1 blocks"),
    ((BL, [0, 4], BUF, 0), ValueError, "block_ids holds"),
    ((BL, [-1], BUF, 0), ValueError, "block_ids"),
    ((BL, [0.5], BUF, 0), TypeError, "block_ids"),
    ((BL, [[0]], BUF, 0), ValueError, "block_ids must be 1-D"),
    ((BL, [0], BUF.half(), 0), TypeError, "out has dtype torch.float16"),
    ((BL, [0], torch.zeros(2, 2, 4, 3, 4), 0), ValueError, "out must be [2, 2, num_tokens, 3, 5]"),
    ((BL[:1], [0], BUF, 0), ValueError, "out must be [1, 2, num_tokens, 3, 5]"),
    ((BL, [0], torch.zeros(2, 2, 4, 5, 3).transpose(3, 4), 0), ValueError, "out must be contiguous"),
    ((BL, [0], "buffer", 0), TypeError, "out must be a torch.Tensor"),
    ((BL[0], [0], BUF, 0), TypeError, "layers must be a sequence"),
    (([], [0], BUF, 0), ValueError, "layers is empty"),
    (([BL[0], "x"], [0], BUF, 0), TypeError, r"layers\[1\] must be a torch.Tensor"),
    (([BL[0], BL[1][0]], [0], BUF, 0), ValueError, r"layers\[1\] must be 5-D"),
    (([BL[0], BL[1][:, :3]], [0], BUF, 0), ValueError, r"layers\[1\] has shape"),
    (([BL[0], BL[1].double()], [0], BUF, 0), TypeError, r"layers\[1\] has dtype torch.float64"),
    (([BL[0], BL[1].to("meta")], [0], BUF, 0), ValueError, r"layers\[1\] is on meta"),
    (([torch.zeros(2, 4, 0, 3, 5)] * 2, [0], torch.zeros(2, 2, 0, 3, 5), 0), ValueError, "block_size >= 1"),
    ((BL, [0], torch.zeros(2, 2, 4, 3, 5, dtype=torch.complex128), 0), TypeError, "out has dtype"),
    (([torch.zeros(2, 4, 2, 3, 5, dtype=torch.complex128)] * 2, [0], BUF, 0), TypeError, "1, 2, 4 or 8 bytes"),
]


@pytest.mark.parametrize("args, error, words", BAD_BLOCK_GATHER)
def test_gather_blocks_rejects_bad_arguments(args: tuple, error: type, words: str) -> None:
    check_rejected(lambda *a: ops.gather_blocks(*a[:3], skip_blocks=a[3]), args, error,
                   words.replace("[2,", r"\[2,").replace("[1,", r"\[1,"))


def test_block_buffer_sharing_memory_with_a_layer_is_refused() -> None:
    whole = torch.zeros(2 * 4 * 2 * 3 * 5 * 3)
    layer = whole[:240].view(2, 4, 2, 3, 5)
    inside = whole[200:320].view(1, 2, 4, 3, 5)
    with pytest.raises(ValueError, match=r"out shares memory with layers\[0\]"):
        ops.gather_blocks([layer], [0], inside)
    apart = whole[240:480].view(1, 2, 8, 3, 5)  # the same storage, other bytes: fine
    ops.gather_blocks([layer], [0], apart)


def test_scatter_blocks_rejects_repeats_and_self_overlap_and_leaves_the_layers() -> None:
    layers = [torch.zeros(2, 4, 2, 3, 5) for _ in range(2)]
    with pytest.raises(ValueError, match="block_ids holds block 1 more than once"):
        ops.scatter_blocks(torch.ones(2, 2, 4, 3, 5), layers, [1, 1])
    with pytest.raises(ValueError, match="src holds 4 tokens"):
        ops.scatter_blocks(torch.ones(2, 2, 4, 3, 5), layers, [1, 2, 3])
    expanded = torch.zeros(2, 4, 1, 3, 5).expand(2, 4, 2, 3, 5)
    with pytest.raises(ValueError, match=r"layers\[1\] has elements that overlap"):
        ops.scatter_blocks(torch.ones(2, 2, 4, 3, 5), [layers[0], expanded], [1])
    ops.gather_blocks([layers[0], expanded], [1], torch.ones(2, 2, 4, 3, 5))  # reading one is fine
    assert not any(t.any() for t in layers)


@given(block_copies())
def test_cpp_block_gather_is_bit_exact(cpp: None, case: dict) -> None:
    layers, buf = make_blocks(case)
    expected = buf.clone()
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._gather_torch(layers, ids, expected, case["skip"])
    torch.ops.radixkv.gather_blocks(layers, ids, buf, case["skip"])
    assert same(buf, expected)


@given(block_copies())
def test_cpp_block_scatter_is_bit_exact(cpp: None, case: dict) -> None:
    layers, buf = make_blocks(case)
    expected = [t.clone() for t in layers]
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._scatter_torch(buf, expected, ids, case["skip"])
    torch.ops.radixkv.scatter_blocks(buf, layers, ids, case["skip"])
    assert all(same(t, e) for t, e in zip(layers, expected))


@pytest.mark.parametrize("layout", ["sbthd", "sbhtd", "cross-layer"])
def test_cpp_multithreaded_block_copy_is_exact(cpp: None, layout: str) -> None:
    # 2 MiB in rows of 16 KiB: the kernel splits the rows over threads.
    gen = torch.Generator().manual_seed(3)
    layers = engine_layers(layout, (8, 2, 24, 16, 4, 64), torch.float16, gen)
    ids = torch.randperm(24, generator=gen)[:8]
    out = torch.empty((8, 2, 8 * 16, 4, 64), dtype=torch.float16)
    ops.gather_blocks(layers, ids, out)
    for l, layer in enumerate(layers):
        assert same(out[l].view(2, 8, 16, 4, 64), layer[:, ids])
    target = engine_layers(layout, (8, 2, 24, 16, 4, 64), torch.float16, gen)
    ops.scatter_blocks(out, target, ids)
    assert all(same(t[:, ids], layer[:, ids]) for t, layer in zip(target, layers))


LAYERS_2 = [torch.zeros(2, 4, 2, 3, 5).transpose(2, 3).contiguous().transpose(2, 3) for _ in range(2)]
CPP_BLOCK_BAD = [
    # arguments straight to the C++ block ops, skipping the Python checks: an exception, never a crash
    (lambda: torch.ops.radixkv.gather_blocks([], torch.tensor([0]), BUF, 0), ValueError, "layers is empty"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([4]), BUF, 0), ValueError,
     r"block_ids\[0\] = 4 is outside the layers"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([0], dtype=torch.int32), BUF, 0), TypeError,
     "block_ids must be int64"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([0]), BUF, 2), ValueError,
     "too few for skip_blocks=2 plus 1 blocks"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([0]), BUF, 2**62), ValueError, "holds 4 tokens"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([0]), BUF, -1), ValueError, "skip_blocks"),
    (lambda: torch.ops.radixkv.gather_blocks([LAYERS_2[0], LAYERS_2[1][0]], torch.tensor([0]), BUF, 0), ValueError,
     r"layers\[1\] must be 5-D"),
    (lambda: torch.ops.radixkv.gather_blocks([LAYERS_2[0], LAYERS_2[1][:, :2]], torch.tensor([0]), BUF, 0),
     ValueError, r"layers\[1\] has shape"),
    (lambda: torch.ops.radixkv.gather_blocks([LAYERS_2[0], LAYERS_2[1].double()], torch.tensor([0]), BUF, 0),
     TypeError, r"layers\[1\] has dtype"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([0]), BUF.half(), 0), TypeError, "out has dtype"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([0]), BUF[:1], 0), ValueError,
     "KV of the layers needs"),
    (lambda: torch.ops.radixkv.gather_blocks(LAYERS_2, torch.tensor([0]),
                                             torch.zeros(2, 2, 4, 5, 3).transpose(3, 4), 0),
     ValueError, "contiguous"),
    (lambda: torch.ops.radixkv.gather_blocks([BL[0], BL[1]], torch.tensor([0]), BL[1].view(2, 2, 4, 3, 5), 0),
     ValueError, "out and the layers share memory"),
    (lambda: torch.ops.radixkv.scatter_blocks(BUF, LAYERS_2, torch.tensor([2, 2]), 0), ValueError,
     "block_ids holds block 2 more than once"),
    (lambda: torch.ops.radixkv.scatter_blocks(BUF, [LAYERS_2[0], LAYERS_2[1][:, :1].expand(2, 4, 2, 3, 5)],
                                              torch.tensor([0]), 0), ValueError, "overlap"),
]


@pytest.mark.parametrize("call, error, words", CPP_BLOCK_BAD)
def test_cpp_block_ops_reject_bad_arguments(cpp: None, call, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        call()
    assert not any(t.any() for t in LAYERS_2)


@pytest.mark.parametrize("per_block", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_block_scatter_both_ways_match_the_definition(layout: str, per_block: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The fallback copies block by block for large rows, with index_copy_ for small ones.
    monkeypatch.setattr(ops, "_PER_BLOCK_SCATTER_BYTES", 1 if per_block else 1 << 40)
    shape = (2, 1, 6, 4, 1, 8) if layout == "mla" else (2, 2, 6, 4, 3, 8)
    case = dict(layout=layout, shape=shape, dtype=torch.float16, ids=[4, 0, 5], skip=1, tokens=20, seed=5)
    layers, buf = make_blocks(case)
    expected = scatter_blocks_by_definition(buf, layers, case["ids"], case["skip"])
    ops._scatter_torch(buf, layers, torch.tensor(case["ids"]), case["skip"])
    assert all(torch.equal(as_bytes(t), e) for t, e in zip(layers, expected))
