"""cuBLAS at raw addresses (`kernels/cublas.py`): the argument mapping against an emulation of cublasGemmEx's
column-major semantics (CPU), and on a GPU the products by address against torch's, and templates' steps through
them in a loop of changing lengths."""

import pytest
import torch
from helpers import rel_err, training_inputs, training_module

from backfuse.kernels import cublas, graphs
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig
from backfuse.ops.wan_xattn.spec import WanXattnConfig
from backfuse.train import program

GPU = torch.cuda.is_available()


def emulate(args, a, b, c, alpha: float, beta: float) -> None:
    """cublasGemmEx with `args` (`cublas.arguments`: transa, transb, m, n, k, lda, ldb, ldc) on CPU tensors' memory
    from their first elements: C[m x n] = alpha op(A) op(B) + beta C, column-major, the library's A being b's memory
    and its B a's."""
    transa, transb, m, n, k, lda, ldb, ldc = args

    def flat(t):
        storage = t.untyped_storage()
        return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(),
                                                  (storage.nbytes() // t.element_size() - t.storage_offset(),))
    op_a = flat(b).as_strided((m, k), (1, lda) if transa == cublas.OP_N else (lda, 1))
    op_b = flat(a).as_strided((k, n), (1, ldb) if transb == cublas.OP_N else (ldb, 1))
    out = flat(c).as_strided((m, n), (1, ldc))
    out.copy_(alpha * (op_a @ op_b) + (beta * out if beta else 0))


def forms(tokens: int, device, dtype, out_dtype=None) -> list:
    """(name, a, b, c, accumulate) in the layouts the training paths multiply: x W^T, dy W (and its += into a
    slice of a wider gradient), a weight gradient dy^T x from a column block of a stacked gradient."""
    g = torch.Generator(device).manual_seed(tokens)
    out_dtype = out_dtype or dtype

    def r(*shape, dt=dtype):
        return (torch.randn(*shape, device=device, generator=g) / shape[-1] ** 0.5).to(dt)
    x, wq, wk, dqkv = r(tokens, 96), r(80, 96), r(48, 96), r(tokens, 176)
    wide = r(tokens, 200, dt=out_dtype)
    return [("x Wq^T", x, wq.T, torch.empty(tokens, 80, device=device, dtype=out_dtype), False),
            ("dq Wq", dqkv[:, :80], wq, torch.empty(tokens, 96, device=device, dtype=out_dtype), False),
            ("+= dk Wk, into a slice", dqkv[:, 80:128], wk, wide[:, 8:104], True),
            ("dqkv^T x", dqkv.T, x, torch.empty(176, 96, device=device, dtype=out_dtype), False),
            ("dk^T x, a column block", dqkv[:, 80:128].T, x, torch.empty(48, 96, device=device, dtype=out_dtype), False)]


@pytest.mark.parametrize("tokens", [1, 37, 130])
def test_the_arguments_give_the_row_major_product(tokens):
    """Every training layout at odd token counts, through the emulated library, against float64 (outputs
    poisoned); and a layout with no unit stride is not served."""
    for name, a, b, c, accumulate in forms(tokens, "cpu", torch.float64):
        want = (c.clone() if accumulate else 0) + a @ b
        if not accumulate:
            c.fill_(float("nan"))
        args = cublas.arguments(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), c.stride())
        emulate(args, a, b, c, 1.0, 1.0 if accumulate else 0.0)
        assert rel_err(c, want) < 1e-12, name
    x = torch.randn(6, 8, 4)[:, :, 0]  # strides (32, 4): no unit stride
    assert cublas.arguments((6, 8), x.stride(), (8, 5), (5, 1), (5, 1)) is None
    assert cublas.gemm((6, 8), (8, 1), (8, 5), (5, 1), (5, 1), torch.float32, torch.float32, False) is None
    assert cublas.gemm((0, 8), (8, 1), (8, 5), (5, 1), (5, 1), torch.bfloat16, torch.bfloat16, False) is None


@pytest.mark.skipif(not GPU, reason="cuBLAS runs on a GPU")
@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                              (torch.float16, torch.float32)], ids=["bf16", "fp16", "fp16-fp32"])
def test_a_product_by_address_is_torchs(dtype, out_dtype):
    """Each layout by address against torch's product of the same tensors (within one rounding of the output:
    torch may take another of cuBLAS's kernels), outputs poisoned."""
    x = torch.ones(8, 8, device="cuda", dtype=dtype)
    torch.mm(x, x)  # torch loads cuBLAS at its first product
    for tokens in (1, 37, 300):
        for name, a, b, c, accumulate in forms(tokens, "cuda", dtype, out_dtype):
            if accumulate and out_dtype is not None:
                continue  # the fp32 paths accumulate in their operands' dtype
            addend = c.clone()
            want = (addend.float() if accumulate else 0) + a.float() @ b.float()
            if not accumulate:
                c.fill_(float("nan"))
            at = cublas.gemm(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), c.stride(), a.dtype, c.dtype,
                             accumulate)
            assert at is not None, name
            at(a.data_ptr(), b.data_ptr(), c.data_ptr())
            assert rel_err(c.float(), want) < 1e-2, (tokens, name)


@pytest.mark.skipif(not GPU, reason="templates serve a GPU's direct launches")
@pytest.mark.parametrize("pid, config, shapes", [
    ("037", Gemma3CoreConfig(256, 4, 2, 64, qk_norm=True), [(2, 61), (1, 200)]),
    ("021", WanXattnConfig(256, 4, qk_norm=True), [(1, 300, 77), (2, 97, 5)]),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_templates_products_by_address_give_torchs_results(pid, config, shapes, dtype, monkeypatch):
    """With graphs off (every call direct, as a changing-length loop's are), a shape's third call runs its
    templates, their plain products by cuBLAS at addresses: the same results as the same calls with those
    products through torch (within the rounding of the outputs; the attention's atomic sums may add in another
    order)."""
    results, made = {}, []
    real = program._by_address
    monkeypatch.setattr(program, "_by_address", lambda *a: made.append(real(*a)) or made[-1])
    for by_address in (True, False):
        monkeypatch.setattr(program, "cublas_products", by_address)
        program._templates.clear()
        torch.manual_seed(3)
        m = training_module(pid, config, dtype, None) if pid == "037" else training_module(pid, config, dtype)
        got = []
        with graphs.cuda_graphs(False):
            for sizes in shapes:
                acts = training_inputs(pid, config, sizes, dtype)
                for _ in range(3):  # the first may compile, the second builds the template, the third runs it
                    m.zero_grad(set_to_none=True)
                    for a in acts:
                        a.grad = None
                    out = m(*acts)
                    out.backward(torch.ones_like(out))
                got.append([out.detach().float()] + [a.grad.float() for a in acts if a.grad is not None]
                           + [p.grad.float() for name, p in m.named_parameters() if name != "key_bias"])
        results[by_address] = got
        if by_address:
            assert any(step is not None for step in made)  # some products ran by address
    for ours, theirs in zip(results[True], results[False]):
        for x, y in zip(ours, theirs):
            assert rel_err(x, y) < 2e-2
