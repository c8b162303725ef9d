"""The sparse FFN kernels: Metal sources (metal/) and their proofs on Linux."""
