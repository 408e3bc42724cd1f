"""One small 072 call per product backend (the one-launch Gluon kernel too, on Hopper), for
compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck python3 benchmarks/checks/sanitize_072.py
"""

import torch

import backfuse

prob = backfuse.problem("072")
x = prob.make_inputs(dict(batch_size=2, seq_len_dec=37, seq_len_enc=19), seed=0, device="cuda")
backends = ("triton", "cublas") + (("gluon",) if torch.cuda.get_device_capability() == (9, 0) else ())
for products in backends:
    out = prob.fused(*x, products=products, sms=132)  # sms=132 forces K splits (atomics)
    torch.cuda.synchronize()
    err = max(((o - r).norm() / r.norm()).item() for o, r in zip(out, prob.reference(*x)))
    print(f"{products}: max relative error {err:.2e}")
