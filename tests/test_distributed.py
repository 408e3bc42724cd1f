"""A patched model under torch.distributed as users scale it: two processes (gloo on a CPU, NCCL on
GPUs where there are two) each take half of every batch, wrapped in DDP or in FSDP2's `fully_shard`
per decoder layer; every step's loss (averaged over the processes) and the final parameters are those
of one process training on the whole batches. The ops take the plain tensors the wrappers hand them
(FSDP2 gathers each layer's parameters before its forward).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import backfuse

transformers = pytest.importorskip("transformers")
STEPS = 4
WORLD = 2
WRAPPERS = ("ddp", "fsdp2")


def _model():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                                           max_position_embeddings=32, attn_implementation="eager",
                                           layer_types=["sliding_attention", "full_attention"])
    model = transformers.Gemma3ForCausalLM(config)
    backfuse.patch(model, quiet=True)
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 96, (WORLD, 9), generator=g) for _ in range(STEPS)]  # no pad token (test_integrations)


def _train(model, rows, device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in _batches():
        ids = ids[rows].to(device)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gpu = torch.cuda.device_count() >= WORLD
    device = f"cuda:{rank}" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=WORLD)
    try:
        results = {}
        for wrapper in WRAPPERS:
            model = _model().to(device)
            if wrapper == "ddp":
                wrapped = torch.nn.parallel.DistributedDataParallel(model)
            else:
                from torch.distributed.fsdp import fully_shard

                for layer in model.model.layers:
                    fully_shard(layer)
                wrapped = fully_shard(model)
            losses = _train(wrapped, slice(rank, rank + 1), device)
            assert backfuse.fallbacks(model) == {}
            dist.all_reduce(losses)
            params = {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                      for n, p in wrapped.named_parameters()}
            results[wrapper] = dict(losses=(losses / WORLD).cpu(), params=params)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()  # both ranks done before either tears its process group down (a rank that fails stops the
        # other through mp.spawn)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < WORLD,
                    reason="two processes take a GPU each here (their CPU form, gloo in the interpreter, is CI's)")
def test_two_processes_train_as_one(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    results = torch.load(out)
    device = "cuda" if torch.cuda.device_count() >= WORLD else "cpu"  # where the two processes ran
    model = _model().to(device)
    expected = _train(model, slice(None), device).cpu()
    for wrapper in WRAPPERS:
        got = results[wrapper]
        assert torch.allclose(got["losses"], expected, rtol=2e-4, atol=0), (wrapper, got["losses"], expected)
        for name, p in model.named_parameters():
            assert (got["params"][name] - p.detach().cpu()).abs().max() <= 5e-3, (wrapper, name)
