"""Speed-of-light times: matrix MACs at a tensor-core rate against fp32 I/O bytes at HBM bandwidth."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    fp16_flops: float  # dense fp16/bf16 tensor-core rate, FLOP/s
    tf32_flops: float  # dense TF32 tensor-core rate, FLOP/s
    hbm_bytes: float  # HBM bandwidth, B/s
    source: str


# H100/H200 SXM datasheet rates; B200 as SOL-ExecBench models it (PROTOCOL.md), TF32 at half of fp16.
GPUS = {
    "h200": GPU("H200", 989e12, 494.7e12, 4.8e12, "NVIDIA H200 SXM datasheet"),
    "h100": GPU("H100", 989e12, 494.7e12, 3.35e12, "NVIDIA H100 SXM datasheet"),
    "b200": GPU("B200", 1.81e15, 0.905e15, 7.7e12, "SOL-ExecBench's B200 model"),
}


def sol_ms(problem, axes: dict, gpu: str = "h200", precision: str = "fp16") -> float:
    """max(2 * MACs / tensor-core rate, I/O bytes / bandwidth), in milliseconds."""
    spec = GPUS[gpu]
    rate = spec.fp16_flops if precision == "fp16" else spec.tf32_flops
    return 1e3 * max(2 * problem.macs(axes) / rate, problem.io_bytes(axes) / spec.hbm_bytes)


def leaderboard_score(t_ms: float, baseline_ms: float, sol: float) -> float:
    """SOL-ExecBench's S = 1 / (1 + (T_k - T_sol) / (T_b - T_sol)): 0.5 at the baseline, 1 at SOL."""
    return 1.0 / (1.0 + (t_ms - sol) / (baseline_ms - sol))
