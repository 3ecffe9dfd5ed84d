"""Block copies on a GPU: the CUDA kernel against the torch reference, bit for bit, device to
device and through pinned host memory, for the pool and for an engine's own layers in every layout
the CPU tests use.  Skipped where torch sees no GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv import ops
from radixkv.core.pool import _POOL_DTYPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the CUDA kernel is not run here")

DTYPES = sorted(_POOL_DTYPES, key=str)


@pytest.fixture(scope="module")
def cuda_ext() -> None:
    assert ops.build() == "cuda+cpp", "torch has CUDA here, so the CUDA kernel must build"


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    # head_dim 1 and 3 with 1-byte dtypes give odd row sizes: the kernel's narrow-vector paths.
    num_pages = draw(st.integers(1, 12))
    return dict(
        shape=(draw(st.integers(1, 8)), 2, num_pages, draw(st.integers(1, 32)), draw(st.integers(1, 3)),
               draw(st.sampled_from([1, 3, 8, 64]))),
        dtype=draw(st.sampled_from(DTYPES)),
        ids=draw(st.lists(st.integers(0, num_pages - 1), max_size=num_pages, unique=True)),
        skip=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def buffers(case: dict, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    layers, _, _, page_size, heads, dim = case["shape"]
    kv = random_bytes(case["shape"], case["dtype"], "cuda", case["seed"])
    tokens = (case["skip"] + len(case["ids"])) * page_size + 1
    buf = random_bytes((layers, 2, tokens, heads, dim), case["dtype"], "cpu", case["seed"] + 1)
    buf = buf.pin_memory() if device == "pinned" else buf.to(device)
    return kv, buf


@pytest.mark.parametrize("where", ["cuda", "pinned"])
@given(case=layouts())
def test_cuda_gather_is_bit_exact(cuda_ext: None, where: str, case: dict) -> None:
    kv, out = buffers(case, where)
    expected = out.cuda()
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._gather_torch(kv, ids, expected, case["skip"])
    torch.ops.radixkv.gather_pages(kv, ids, out, case["skip"])
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(out), as_bytes(expected))


@pytest.mark.parametrize("where", ["cuda", "pinned"])
@given(case=layouts())
def test_cuda_scatter_is_bit_exact(cuda_ext: None, where: str, case: dict) -> None:
    kv, src = buffers(case, where)
    expected = kv.clone()
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._scatter_torch(src.cuda(), expected, ids, case["skip"])
    torch.ops.radixkv.scatter_pages(src, kv, ids, case["skip"])
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(kv), as_bytes(expected))


def test_page_ids_on_the_device_work(cuda_ext: None) -> None:
    kv = torch.randn(2, 2, 6, 4, 2, 8, device="cuda")
    ids = torch.tensor([5, 0, 3], device="cuda")
    out = ops.gather_pages(kv, ids)
    assert torch.equal(out.view(2, 2, 3, 4, 2, 8), kv[:, :, ids])
    with pytest.raises(ValueError, match="outside the pool"):
        torch.ops.radixkv.gather_pages(kv, torch.tensor([6], device="cuda"), out, 0)


def test_pinned_round_trip_through_the_public_api(cuda_ext: None) -> None:
    kv = torch.randn(4, 2, 16, 16, 2, 64, device="cuda", dtype=torch.float16)
    ids = torch.randperm(16)[:8]
    chunk = torch.empty((4, 2, 10 * 16, 2, 64), dtype=torch.float16).pin_memory()
    ops.gather_pages(kv, ids, chunk, skip_pages=2)
    torch.cuda.synchronize()
    assert torch.equal(chunk[:, :, 32:].view(4, 2, 8, 16, 2, 64), kv[:, :, ids.cuda()].cpu())
    target = torch.randperm(16)[:8]
    ops.scatter_pages(chunk, kv, target, skip_pages=2)
    del chunk  # the pinned block must not be reused before the kernel is done with it
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :, target.cuda()], kv[:, :, ids.cuda()])


def test_pageable_host_buffer_is_refused(cuda_ext: None) -> None:
    kv = torch.zeros(1, 2, 4, 2, 1, 8, device="cuda")
    pageable = torch.zeros(1, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="pinned"):
        ops.gather_pages(kv, [0, 1], pageable)
    with pytest.raises(ValueError, match="pageable"):
        torch.ops.radixkv.gather_pages(kv, torch.tensor([0, 1]), pageable, 0)
    with pytest.raises(ValueError, match="must be on"):
        ops.scatter_pages(torch.zeros(1, 2, 4, 1, 8, device="cuda"), torch.zeros(1, 2, 4, 2, 1, 8), [0])


# ------------------------------------------------------- an engine's own layers (gather_blocks)


def _cpu_tests() -> ModuleType:
    """tests/core/test_ops.py, loaded by path for its layouts and strategies (tests are not a package)."""
    spec = importlib.util.spec_from_file_location("_radixkv_cpu_op_tests", Path(__file__).with_name("test_ops.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cpu = _cpu_tests()


def block_case(case: dict, where: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The case's layers on the GPU and its chunk buffer on the GPU or in pinned host memory."""
    gen = torch.Generator().manual_seed(case["seed"])
    layers = cpu.engine_layers(case["layout"], case["shape"], case["dtype"], gen, device="cuda")
    num_layers, sides, _, _, heads, dim = case["shape"]
    buf = cpu.random_bytes((num_layers, sides, case["tokens"], heads, dim), case["dtype"], gen)
    return layers, buf.pin_memory() if where == "pinned" else buf.cuda()


@pytest.mark.parametrize("where", ["cuda", "pinned"])
@given(case=cpu.block_copies())
def test_cuda_block_gather_is_bit_exact(cuda_ext: None, where: str, case: dict) -> None:
    layers, out = block_case(case, where)
    expected = out.cuda()
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._gather_torch(layers, ids, expected, case["skip"])
    torch.ops.radixkv.gather_blocks(layers, ids, out, case["skip"])
    torch.cuda.synchronize()
    assert cpu.same(out.cpu(), expected.cpu())


@pytest.mark.parametrize("where", ["cuda", "pinned"])
@given(case=cpu.block_copies())
def test_cuda_block_scatter_is_bit_exact(cuda_ext: None, where: str, case: dict) -> None:
    layers, src = block_case(case, where)
    expected = [t.clone() for t in layers]
    ids = torch.tensor(case["ids"], dtype=torch.int64)
    ops._scatter_torch(src.cuda(), expected, ids, case["skip"])
    torch.ops.radixkv.scatter_blocks(src, layers, ids, case["skip"])
    torch.cuda.synchronize()
    assert all(cpu.same(t.cpu(), e.cpu()) for t, e in zip(layers, expected))


@pytest.mark.parametrize("layout", cpu.LAYOUTS)
def test_block_round_trip_through_pinned_memory(cuda_ext: None, layout: str) -> None:
    # Large rows (32 KiB for the contiguous layouts): many pieces per warp, the 16-byte vector path.
    gen = torch.Generator().manual_seed(4)
    shape = (4, 1, 32, 16, 1, 576) if layout == "mla" else (4, 2, 32, 16, 8, 128)
    layers = cpu.engine_layers(layout, shape, torch.bfloat16, gen, device="cuda")
    ids = torch.randperm(32, generator=gen)[:8].cuda()  # ids on the device: read back once, for the checks
    chunk = torch.empty((4, shape[1], 10 * 16, shape[4], shape[5]), dtype=torch.bfloat16).pin_memory()
    ops.gather_blocks(layers, ids, chunk, skip_blocks=2)
    torch.cuda.synchronize()
    for l, layer in enumerate(layers):
        assert cpu.same(chunk[l, :, 32:].view(shape[1], 8, 16, shape[4], shape[5]), layer[:, ids].cpu())
    target = torch.randperm(32, generator=gen)[:8]
    ops.scatter_blocks(chunk, layers, target, skip_blocks=2)
    del chunk  # the pinned block must not be reused before the kernel is done with it
    torch.cuda.synchronize()
    assert all(cpu.same(t[:, target.cuda()].cpu(), t[:, ids].cpu()) for t in layers)


def test_block_ops_refuse_mixed_devices_and_pageable_buffers(cuda_ext: None) -> None:
    layers = [torch.zeros(2, 4, 2, 1, 8, device="cuda") for _ in range(2)]
    with pytest.raises(ValueError, match=r"layers\[1\] is on cpu"):
        ops.gather_blocks([layers[0], layers[1].cpu()], [0], torch.zeros(2, 2, 2, 1, 8, device="cuda"))
    with pytest.raises(ValueError, match=r"layers\[1\] is on cpu"):
        torch.ops.radixkv.gather_blocks([layers[0], layers[1].cpu()], torch.tensor([0]),
                                        torch.zeros(2, 2, 2, 1, 8, device="cuda"), 0)
    with pytest.raises(ValueError, match="pinned"):
        ops.gather_blocks(layers, [0], torch.zeros(2, 2, 2, 1, 8))
    with pytest.raises(ValueError, match="pageable"):
        torch.ops.radixkv.gather_blocks(layers, torch.tensor([0]), torch.zeros(2, 2, 2, 1, 8), 0)
    with pytest.raises(ValueError, match="outside the layers"):
        torch.ops.radixkv.scatter_blocks(torch.zeros(2, 2, 2, 1, 8, device="cuda"), layers,
                                         torch.tensor([4], device="cuda"), 0)
    assert not any(t.any() for t in layers)
