"""Rotary position embedding of the decoder's query and key heads."""
