"""Triton building blocks shared by the operators."""
