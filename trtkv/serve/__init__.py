"""Serving trtkv engines with Triton Inference Server.

Submodules are imported lazily by their users: PyTriton and tritonclient are
the optional `serve` extra, and the deployed Triton model imports only
`protocol` and `triton_model` inside Triton's Python stub.
"""
