"""RMS normalization of the decoder's hidden states."""
