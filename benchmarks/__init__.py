"""Benchmarks: tokenmill against its peers on this machine (see hf_compare)."""
