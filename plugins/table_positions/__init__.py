"""The token position behind every column of a layer's paged-attention logits, from its block table (one pass)."""
