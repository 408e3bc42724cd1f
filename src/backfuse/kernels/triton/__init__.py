"""Triton device code shared by the operators: product tiles (`gemm`), memory passes and the fp16
range guard's tile maximum (`elementwise`), programmatic dependent launch (`pdl`)."""
