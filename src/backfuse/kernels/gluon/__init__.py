"""Hopper (sm_90) kernels in Gluon, Triton's lower-level dialect: explicit TMA, mbarriers, wgmma
and warp specialization. Used only on sm_90 GPUs; elsewhere the Triton (`tl`) kernels run."""
