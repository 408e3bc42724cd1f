"""Masks in the training attention (`F.gemma3_core(attention_mask=, cu_seqlens=, cu_seqlens_k=)`, `steps.Masking`): key
padding (left, right, all ones, holes), packed documents (each against float64 computing that document alone; queries
and keys apart as FlashAttention aligns them),
4-dim masks transformers builds (bool, additive 0 / finfo.min, image blocks that see each other both ways),
rows that see no key, and the refusals. On a GPU at Gemma 3 4B's width; in the interpreter at a small one.
"""

import pytest
import torch
from conftest import DEVICE
from helpers import attention64, rel_err, rope_tables, training_module

from backfuse import functional as F
from backfuse.bench.train import _gemma_norm, _rotate_half
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig

GPU = DEVICE == "cuda"
# Gemma 3 4B's attention (2560 wide, 8 heads of 256 over 4 KV heads) on a GPU; a small one in the interpreter.
CONFIG = Gemma3CoreConfig(2560, 8, 4, 256) if GPU else Gemma3CoreConfig(64, 4, 2, 16)
SEQ = 1000 if GPU else 23
DTYPES = [torch.bfloat16, torch.float32] if GPU else [torch.float32]
TOL = {torch.float32: 3e-3, torch.bfloat16: 3e-2}


def _layer(dtype, window=0, softcap=None):
    torch.manual_seed(0)
    cfg = Gemma3CoreConfig(CONFIG.hidden, CONFIG.heads, CONFIG.kv_heads, CONFIG.head_dim, window)
    return training_module("037", cfg, dtype, softcap)


def _call(m, x, cos, sin, **masks):
    return F.gemma3_core(x, cos, sin, m.q_weight, m.k_weight, m.v_weight, m.o_weight, m.q_norm_weight, m.k_norm_weight,
                         m.scaling, m.softcap, m.eps, window=m.config.window, head_dim=m.config.head_dim, **masks)


def _float64(m, x, cos, sin, visible=None, additive=None):
    """The layer in float64 with `visible` [B, S, S] (else causal within the window) and an additive mask."""
    p = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    x = x.detach().double().requires_grad_()
    c, (b, s, _) = m.config, x.shape
    lin = torch.nn.functional.linear
    q = _gemma_norm(lin(x, p["q_weight"]).view(b, s, c.heads, -1).transpose(1, 2), p["q_norm_weight"], m.eps)
    k = _gemma_norm(lin(x, p["k_weight"]).view(b, s, c.kv_heads, -1).transpose(1, 2), p["k_norm_weight"], m.eps)
    v = lin(x, p["v_weight"]).view(b, s, c.kv_heads, -1).transpose(1, 2)
    cos, sin = cos.double()[:, None], sin.double()[:, None]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k.repeat_interleave(c.group, 1), v.repeat_interleave(c.group, 1)
    z = q @ k.transpose(-1, -2) * m.scaling
    if m.softcap:
        z = m.softcap * torch.tanh(z / m.softcap)
    if additive is not None:  # as eager attention: a row whose mask hides every key weighs them all alike
        z = z + additive.double()
    else:
        if visible is None:
            i = torch.arange(s, device=x.device)
            visible = (i[None] <= i[:, None]) & ((i[:, None] - i[None]) < (c.window or s))
        z = z.masked_fill(~visible[:, None] if visible.dim() == 3 else ~visible, float("-inf"))
    a = torch.softmax(z, -1).nan_to_num(0.0) @ v  # a row that sees no key: 0, as SDPA gives it
    return lin(a.transpose(1, 2).reshape(b, s, -1), p["o_weight"]), p, x


def _compare(m, x, cos, sin, masks, visible=None, additive=None, rows=None):
    """Output (on `rows`: the positions a loss would read) and every gradient against float64."""
    x = x.detach().requires_grad_()
    out = _call(m, x, cos, sin, **masks)
    grad = torch.randn_like(out)
    if rows is not None:
        grad = grad * rows[..., None].to(grad.dtype)
    out.backward(grad)
    ref, params, x64 = _float64(m, x, cos, sin, visible, additive)
    ref.backward(grad.double())
    tol = TOL[x.dtype]
    keep = torch.ones(out.shape[:2], dtype=torch.bool, device=out.device) if rows is None else rows.bool()
    assert torch.isfinite(out).all()
    assert rel_err(out[keep], ref[keep]) < tol
    assert rel_err(x.grad, x64.grad) < tol
    for name, p in m.named_parameters():
        assert rel_err(p.grad, params[name].grad) < tol, name


def _inputs(dtype, batch, seq=SEQ):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(batch, seq, CONFIG.hidden, generator=g) / CONFIG.hidden ** 0.5).to(DEVICE, dtype)
    cos, sin = rope_tables(seq, CONFIG.head_dim, dtype)
    return x, cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)


def _padding(kind: str, batch: int, seq: int):
    mask = torch.ones(batch, seq, dtype=torch.int64, device=DEVICE)  # as a tokenizer returns it
    if kind == "left":
        mask[0, :seq // 3] = 0
    elif kind == "right":
        mask[1, seq - seq // 4:] = 0
    elif kind == "holes":
        mask[0, 3:7] = 0
        mask[1, seq // 2] = 0
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["ones", "left", "right", "holes"])
@pytest.mark.parametrize("window", [0, 7 if not GPU else 300], ids=["global", "window"])
def test_key_padding(kind, window, dtype):
    """A [B, S] mask as tokenizers return it: a query sees the real keys of its causal window; the outputs a
    loss reads (real tokens) and every gradient as float64's."""
    m = _layer(dtype, window)
    x, cos, sin = _inputs(dtype, 2)
    mask = _padding(kind, 2, x.shape[1])
    i = torch.arange(x.shape[1], device=DEVICE)
    visible = (i[None] <= i[:, None]) & (i[:, None] - i[None] < (window or x.shape[1]))
    _compare(m, x, cos, sin, dict(attention_mask=mask), visible[None] & mask.bool()[:, None], rows=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap, window", [(None, 0), (30.0, 0), (None, 5 if not GPU else 200)],
                         ids=["gemma3", "softcap", "window"])
def test_packed_documents_equal_each_document_alone(dtype, softcap, window):
    """cu_seqlens (FlashAttention's varlen form) with RoPE positions restarting per document: each document's
    output and its tokens' gradients are the float64 layer's on that document alone (within the sliding window
    where the layer has one: a sliding-window layer under FlashAttention's varlen path)."""
    m = _layer(dtype, window, softcap)
    lengths = [SEQ // 3, 1, SEQ - SEQ // 3 - 1 - SEQ // 5, SEQ // 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    x, _, _ = _inputs(dtype, 1)
    tables = [rope_tables(n, CONFIG.head_dim, dtype) for n in lengths]
    cos, sin = (torch.cat([t[j] for t in tables], 1) for j in (0, 1))
    x = x.detach().requires_grad_()
    out = _call(m, x, cos, sin, cu_seqlens=cu)
    grad = torch.randn_like(out)
    out.backward(grad)
    tol = TOL[dtype]
    for (start, end), (c, s) in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), tables):
        alone, _, x64 = _float64(m, x[:, start:end], c, s)
        alone.backward(grad[:, start:end].double())
        assert rel_err(out[:, start:end], alone) < tol, (start, end)
        assert rel_err(x.grad[:, start:end], x64.grad) < tol, (start, end)


def _flash_visible(cu_q, cu_k, s, window):
    """[S, S]: which keys each query sees by FlashAttention's varlen rule (its docstring): in document i, local query
    a sees local keys up to a + len_k - len_q, and with a window of w tokens none before that - (w - 1)."""
    visible = torch.zeros(s, s, dtype=torch.bool)
    for a, b, c, e in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        for t in range(a, b):
            last = c + (t - a) + (e - c) - (b - a)
            first = max(c, last - window + 1) if window else c
            if last >= first:
                visible[t, first:last + 1] = True
    return visible.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap, window", [(None, 0), (30.0, 0), (None, 5 if not GPU else 200)],
                         ids=["gemma3", "softcap", "window"])
def test_documents_whose_queries_and_keys_differ_as_flash_attention_aligns_them(dtype, softcap, window):
    """cu_seqlens and cu_seqlens_k apart (FlashAttention's varlen pair, as transformers passes a collator's two
    tensors): causality ends at each document's last query and last key together, so a query may see keys past
    its own position or none at all; a document with no queries, queries before the first document and after
    the last see nothing (0). Output and every gradient against float64 with FlashAttention's rule; the pair
    with equal values computes what one cu_seqlens does."""
    m = _layer(dtype, window, softcap)
    s = SEQ
    cu_q = [2, s * 3 // 10, s * 3 // 10, s * 6 // 10, s - 3]
    cu_k = [0, s * 3 // 10 + 1, s * 4 // 10, s * 5 // 10, s]
    x, cos, sin = _inputs(dtype, 1)
    q_docs, k_docs = (torch.tensor(cu, dtype=torch.int32, device=DEVICE) for cu in (cu_q, cu_k))
    visible = _flash_visible(cu_q, cu_k, s, window)
    assert visible.any(1).sum() < s - 5 and (visible.triu(1)).any()  # rows that see nothing, keys past the query
    _compare(m, x, cos, sin, dict(cu_seqlens=q_docs, cu_seqlens_k=k_docs), visible[None])
    one = _call(m, x, cos, sin, cu_seqlens=q_docs)
    assert torch.equal(_call(m, x, cos, sin, cu_seqlens=q_docs, cu_seqlens_k=q_docs.clone()), one)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["bool", "additive"])
def test_a_4_dim_mask_decides_alone(form, dtype):
    """transformers' [B, 1, S, S] masks (bool for SDPA, 0 / finfo.min of the model's dtype for eager): causal
    with an image block whose tokens see each other both ways, left padding in one row (its padded queries see
    no key: 0 as SDPA gives them, or every key alike as eager attention weighs them)."""
    m = _layer(dtype, softcap=30.0 if form == "additive" else None)
    x, cos, sin = _inputs(dtype, 2)
    s = x.shape[1]
    i = torch.arange(s, device=DEVICE)
    image = (i >= s // 4) & (i < s // 4 + s // 5)
    visible = ((i[None] <= i[:, None]) | (image[:, None] & image[None]))[None].repeat(2, 1, 1)
    visible[1, :, :5] = False  # left padding: keys 0-4 hidden from every query of row 1
    mask = visible[:, None] if form == "bool" else torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]
    _compare(m, x, cos, sin, dict(attention_mask=mask), visible, additive=mask if form == "additive" else None)


def test_a_mask_laid_out_otherwise_gets_launches_of_its_own():
    """The kernels read a mask as it is, with its strides in their arguments. A call whose mask has the shape and
    dtype of earlier ones but other strides (a [1, 1, S, S] mask expanded to the batch: batch stride 0) must not
    run the launches a template or graph took from those calls (batch stride S * S would read the second
    entry's mask from the memory after the first: here a block that hides every key)."""
    dtype = DTYPES[0]
    m = _layer(dtype)
    x, cos, sin = _inputs(dtype, 2)
    s = x.shape[1]
    i = torch.arange(s, device=DEVICE)
    visible = (i[None] <= i[:, None]) & ((i[:, None] - i[None]) < s // 3)
    for _ in range(3):  # a template (and on a GPU a graph, at the third call) of the contiguous layout
        _call(m, x, cos, sin, attention_mask=visible[None, None].expand(2, 1, s, s).contiguous())
    after = torch.zeros(2, 1, s, s, dtype=torch.bool, device=DEVICE)
    after[0, 0] = visible
    _compare(m, x, cos, sin, dict(attention_mask=after[:1].expand(2, 1, s, s)), visible[None].expand(2, s, s))


def test_a_broadcast_4_dim_mask_and_one_hiding_everything_from_a_query():
    """A [1, 1, S, S] mask serves every row; a query that sees no key gets 0 and no NaN reaches a gradient."""
    dtype = DTYPES[0]
    m = _layer(dtype)
    x, cos, sin = _inputs(dtype, 2)
    s = x.shape[1]
    i = torch.arange(s, device=DEVICE)
    visible = i[None] <= i[:, None]
    visible[3] = False
    out = _call(m, x, cos, sin, attention_mask=visible[None, None])
    assert out[:, 3].abs().max() == 0
    _compare(m, x, cos, sin, dict(attention_mask=visible[None, None].expand(2, 1, s, s)), visible[None].expand(2, s, s))


def test_mask_refusals_name_the_input():
    m = _layer(DTYPES[0])
    x, cos, sin = _inputs(DTYPES[0], 2)
    s = x.shape[1]
    with pytest.raises(ValueError, match=r"input 'attention_mask' must be \[batch_size=2, seq_len="):
        _call(m, x, cos, sin, attention_mask=torch.ones(2, s + 1, device=DEVICE))
    with pytest.raises(ValueError, match="input 'cu_seqlens' must be an integer tensor"):
        _call(m, x[:1], cos[:1], sin[:1], cu_seqlens=torch.tensor([0.0, s], device=DEVICE))
    with pytest.raises(ValueError, match=r"input 'hidden_states' must be one row of packed documents \[1, tokens"):
        _call(m, x, cos, sin, cu_seqlens=torch.tensor([0, s], dtype=torch.int32, device=DEVICE))
    docs = torch.tensor([0, s], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="input 'cu_seqlens_k' needs cu_seqlens"):
        _call(m, x[:1], cos[:1], sin[:1], cu_seqlens_k=docs)
    with pytest.raises(ValueError, match="input 'cu_seqlens_k' must be an integer tensor"):
        _call(m, x[:1], cos[:1], sin[:1], cu_seqlens=docs, cu_seqlens_k=[0, s])
    with pytest.raises(ValueError, match="must count the same documents, got 1 and 2"):
        _call(m, x[:1], cos[:1], sin[:1], cu_seqlens=docs, cu_seqlens_k=torch.tensor([0, 3, s], device=DEVICE))
    with pytest.raises(ValueError, match="not both"):
        _call(m, x[:1], cos[:1], sin[:1], cu_seqlens=torch.tensor([0, s], dtype=torch.int32, device=DEVICE),
              attention_mask=torch.ones(1, 1, s, s, dtype=torch.bool, device=DEVICE))


def _bounds(a):
    """`steps.bounds_buffer`'s tensor for attention a, poisoned (an element the bounds pass does not write shows)."""
    from backfuse.train import steps

    spec = steps.bounds_buffer(a)
    return torch.full(spec.shape, -7, dtype=spec.dtype, device=DEVICE)


def test_the_bounds_pass_reads_no_mask_row_past_the_last_query():
    """A row block that runs past S_q reads none of the mask's rows beyond it (on a GPU: memory past the
    tensor's end). Here the additive mask is the head of a larger buffer whose next rows hold values that
    overflow the mask's arithmetic, with numpy's overflow raised (in the interpreter, which reads what a GPU
    would); the bounds are the causal ones."""
    import numpy as np

    from backfuse.train import masks, steps

    s = 11  # no row block divides it
    buffer = torch.full((1, 1, s + 64, s), 3e38, device=DEVICE)
    buffer[0, 0, :s] = torch.where(torch.ones(s, s, dtype=torch.bool, device=DEVICE).tril(), 0.0,
                                   torch.finfo(torch.float32).min)
    mask = buffer[:, :, :s]
    a = steps.Attention(1, s, s, 2, 2, 16, causal=True, window=0, softcap=0.0, masking=masks.masking_of(mask, None))
    bounds = _bounds(a)
    with np.errstate(over="raise", invalid="raise"):
        for launch in steps.attention_bounds(a, bounds, mask, None):
            launch()
    lo, hi, k_lo, k_hi = bounds[:4, :s].tolist()
    assert lo == [0] * s and [h % (1 << 30) for h in hi] == list(range(s))
    assert k_lo == list(range(s)) and k_hi == [s - 1] * s  # each key seen by the queries from it on, exactly


@pytest.mark.parametrize("form", ["bool", "additive", "documents"])
def test_each_keys_bounds_are_the_queries_that_see_it(form):
    """`attention_key_bounds_kernel` against the rows' bounds read on the host: a key's [k_lo, k_hi] are the first
    and last query whose bounds reach it, and it is marked unless exactly those queries see it (no gap between
    them, none of them partial). The masks mix exact keys (causal, padding, documents) with marked ones: holes, a
    value added. A query that sees nothing under an additive mask weighs every key alike: it is no key's, and
    its batch entry's first and last such query are listed apart."""
    from backfuse.train import masks, steps

    b, s = 2, 45  # no block of the kernels divides it
    i = torch.arange(s)
    visible = (i[None, :] <= i[:, None]).repeat(b, 1, 1)
    documents = None
    if form == "documents":  # each query's first key (its document's start) and last (itself)
        cut = torch.tensor([0, 13, 29, s])
        starts = cut[torch.searchsorted(cut, i, right=True) - 1]
        documents = torch.stack([starts, i]).to(torch.int32)[:, None].repeat(1, b, 1)
        mask = None
    else:
        visible[0, 20:23, 5:9] = False  # holes in some rows: their keys are marked
        visible[1, :, 40:] = False  # key padding: exact
        visible[1, 3] = False  # a query that sees nothing
        if form == "bool":
            mask = visible[:, None]
        else:
            mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]
            mask[0, 0, 30, 2] = -0.5  # a value added: row 30 partial
    mask = None if mask is None else mask.to(DEVICE)
    documents = None if documents is None else documents.to(DEVICE)
    a = steps.Attention(b, s, s, 2, 2, 16, causal=True, masking=masks.masking_of(mask, documents))
    bounds = _bounds(a)
    for launch in steps.attention_bounds(a, bounds, mask, documents):
        launch()
    lo, hi, k_lo, k_hi = bounds[:4, :b * s].view(4, b, s).cpu().to(torch.int64)
    partial = hi >= 1 << 30
    hi = hi - partial * (1 << 30)
    alike = lo < 0
    assert alike.any() == (form == "additive")  # entry 1's query 3 sees nothing
    if form == "additive":
        assert bounds[4, :2 * b].tolist() == [s, -1, 3, 3]
    for e in range(b):
        for j in range(s):
            seen = [q for q in range(s) if lo[e, q] <= j <= hi[e, q] and not alike[e, q]]
            exact = not seen or (seen == list(range(seen[0], seen[-1] + 1)) and not any(partial[e, q] for q in seen))
            assert (k_lo[e, j].item(), k_hi[e, j].item()) == (
                (seen[0] if seen else s), (seen[-1] if seen else -1) + (0 if exact else 1 << 30)), (e, j, seen)
    if form != "documents":  # the mask's marked keys are there, and so are exact ones
        assert (k_hi >= 1 << 30).any() and (k_hi < 1 << 30).any()


@pytest.mark.parametrize("cap, split, dq_atomic", [(0.0, 1, False), (30.0, 3, True), (30.0, 2, False), (0.0, 3, True)])
def test_queries_weighing_every_key_alike_leave_the_keys_exact(cap, split, dq_atomic):
    """Eager attention's left-padded queries see no key through an additive mask and weigh every key alike
    (Gemma 2 trains on eager attention; Gemma's tokenizers pad on the left). They take no part in the keys'
    bounds, so a padded entry's keys keep the exact loop, and every key block visits them in a loop of their
    own. The attention kernels (key blocks split or not, dQ by atomics or by programs) against float64 adding the
    mask as eager does, on poisoned outputs: left padding, right padding (no such query), left padding with
    holes (keys whose loop reads the mask, which then takes those queries in), and left padding over whole query
    blocks (70 rows: the interpreter's first two blocks of 32, the GPU's first of 64), whose forward reads V
    alone."""
    import math

    from backfuse.train import masks, steps

    torch.manual_seed(0)
    b, s, heads, group, d = 4, 90, 4, 2, 32
    i = torch.arange(s)
    visible = (i[None] <= i[:, None]).repeat(b, 1, 1)
    visible[0, :, :7] = False  # left padding: queries 0-6 see nothing
    visible[1, :, 38:] = False  # right padding: every query sees a real key
    visible[2, :, :3] = False
    visible[2, 20:23, 5:9] = False
    visible[3, :, :70] = False  # queries 0-69 see nothing
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None].to(DEVICE)
    a = steps.Attention(b, s, s, heads, group, d, causal=True, softcap=cap, masking=masks.masking_of(mask, None))
    bounds = _bounds(a)
    for launch in steps.attention_bounds(a, bounds, mask):
        launch()
    k_hi = bounds[3, :b * s].view(b, s).cpu()
    assert bounds[4, :2 * b].tolist() == [0, 6, s, -1, 0, 2, 0, 69]
    assert (k_hi[[0, 1, 3]] < 1 << 30).all() and (k_hi[2] >= 1 << 30).any()  # padded entries exact; holes marked

    kv = heads // group
    q, k, v, do = (torch.randn(b * s, w * d, device=DEVICE).to(torch.bfloat16) for w in (heads, kv, kv, heads))
    nan = float("nan")
    o, lse, delta = torch.full_like(q, nan), *(torch.full((b * heads, s), nan, device=DEVICE) for _ in range(2))
    dq = torch.zeros(b * s, heads * d, device=DEVICE) if dq_atomic else torch.full_like(q, nan)
    dk, dv = ((torch.zeros(b * s, kv * d, device=DEVICE) for _ in range(2)) if split > 1 else
              (torch.full_like(k, nan), torch.full_like(v, nan)))
    tiles, scale = steps.attention_tiles(d, GPU), 1 / math.sqrt(d)
    for launch in (*steps.attention_forward(a, tiles, q, k, v, o, lse, scale, None, bounds=bounds, mask=mask),
                   steps.attention_delta(a, o, do, delta, None),
                   *steps.attention_backward(a, tiles, split, q, k, v, do, lse, delta, dq, dk, dv, scale, None,
                                             dq_atomic=dq_atomic, bounds=bounds, mask=mask)):
        launch()
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attention64(*exact, b, heads, group, d, scale, cap, False, 0, additive=mask)
    ref.backward(do.double())
    assert rel_err(o, ref) < 3e-2
    for name, got, x in zip("qkv", (dq, dk, dv), exact):
        assert rel_err(got, x.grad) < 3e-2, name


def test_the_layers_of_a_forward_share_its_documents():
    """`masks.documents` makes the documents once for calls that pass the same cu_seqlens (a forward's layers), and
    afresh where the tensors, their values (in place), the token count or the pair differ, and for inference
    tensors (no version counter to tell an in-place change)."""
    from backfuse.train import masks

    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    first = masks.documents(cu, None, 7)
    assert masks.documents(cu, None, 7) is first
    cu[1] = 4
    moved = masks.documents(cu, None, 7)
    assert moved is not first and moved[0, 0, 3].item() == 0  # token 3 now in the first document
    keys = cu.clone()
    pair = masks.documents(cu, keys, 7)
    assert pair is not moved and masks.documents(cu, keys, 7) is pair and masks.documents(cu, None, 8) is not pair
    with torch.inference_mode():
        made_there = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
        assert masks.documents(made_there, None, 5) is not masks.documents(made_there, None, 5)


@pytest.mark.parametrize("cu, cu_k, tokens", [
    ([0, 37], None, 37),  # one document
    ([0, 1, 2, 3], None, 3),  # one-token documents
    ([0, 5, 5, 18, 40], None, 613),  # an empty document; tokens after the last document in none
    ([0, 20, 31, 77], [0, 25, 31, 90], 77),  # the keys' documents other than the queries' (FlashAttention's pair)
    ([0, 7, 300, 301, 1000, 1024], [0, 3, 296, 300, 990, 1024], 1024),
    (list(range(0, 258, 2)), None, 256)])  # 128 documents: seven halvings
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_documents_kernel_computes_the_documents(cu, cu_k, tokens, dtype):
    """`steps.packed_documents` (one kernel) against `masks.documents_from_cu_seqlens` (torch's ops), into
    poisoned memory: every query's first and last visible key, also outside every document."""
    from backfuse.train import masks, steps

    cu = torch.tensor(cu, dtype=dtype, device=DEVICE)
    cu_k = None if cu_k is None else torch.tensor(cu_k, dtype=dtype, device=DEVICE)
    got = steps.packed_documents(cu, cu_k, tokens)
    assert got.dtype == torch.int32 and got.shape == (2, 1, tokens)
    assert torch.equal(got, masks.documents_from_cu_seqlens(cu, cu_k, tokens))


@pytest.mark.skipif(DEVICE != "cuda", reason="templates serve a GPU's direct launches")
def test_the_documents_kernel_runs_its_template_at_other_documents(monkeypatch):
    """Packed batches of changing document lengths at one token and document count run the documents kernel's
    template (no launch prepared), right at every call; so do calls whose addresses recur past the graph
    recording's call (a graph of one launch is never recorded, and its key's later calls take the template)."""
    from backfuse.kernels import graphs
    from backfuse.train import masks, program, steps

    runs = []
    real = program.Template.run
    monkeypatch.setattr(program.Template, "run", lambda self, tensors, addresses: (runs.append(1), real(self, tensors, addresses)))
    rng = torch.Generator().manual_seed(3)
    for _ in range(6):
        cuts = sorted((torch.randperm(998, generator=rng)[:4] + 1).tolist())
        cu = torch.tensor([0, *cuts, 999], dtype=torch.int32, device=DEVICE)
        assert torch.equal(steps.packed_documents(cu, None, 1000), masks.documents_from_cu_seqlens(cu, None, 1000))
    assert len(runs) >= 3, runs  # the first may compile, the second builds the template
    cu = torch.tensor([0, 300, 301, 1000], dtype=torch.int32, device=DEVICE)
    for i in range(4 * graphs.RECORD_AT + 4):  # addresses cycling over up to 4 blocks reach RECORD_AT by then
        start = len(runs)
        assert torch.equal(steps.packed_documents(cu, None, 1000), masks.documents_from_cu_seqlens(cu, None, 1000))
        if i >= 4 * graphs.RECORD_AT:
            assert len(runs) == start + 1, i


def test_a_packed_forward_makes_its_documents_by_the_kernel(monkeypatch):
    """gemma3_core's documents come from `steps.packed_documents` (one launch), torch's ops left to torch.compile
    and CUDA graph captures."""
    from backfuse.train import masks, steps

    made = []
    kernel = steps.packed_documents
    monkeypatch.setattr(steps, "packed_documents", lambda *a: made.append(a) or kernel(*a))
    monkeypatch.setattr(masks, "_last", [(), None])
    config = Gemma3CoreConfig(256, 2, 1, 128)
    m = training_module("037", config, torch.float32)
    x = torch.randn(1, 45, 256, device=DEVICE)
    cos, sin = rope_tables(45, 128, torch.float32, DEVICE)
    cu = torch.tensor([0, 12, 45], dtype=torch.int32, device=DEVICE)
    F.gemma3_core(x, cos, sin, m.q_weight, m.k_weight, m.v_weight, m.o_weight, m.q_norm_weight, m.k_norm_weight,
                  m.scaling, m.softcap, m.eps, head_dim=128, cu_seqlens=cu)
    assert len(made) == 1 and made[0][0] is cu

