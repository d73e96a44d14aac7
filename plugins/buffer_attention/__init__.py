"""Decode attention over the residual buffers (each request's last tokens, not yet flushed to pages)."""
