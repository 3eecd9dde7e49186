"""Benchmark and log tools (layer shapes, megakernel timelines, Megatron log parsing).

Used by ``scripts/`` and the tests; the library itself never imports this package.
"""
