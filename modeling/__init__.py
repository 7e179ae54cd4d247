"""Llama-family model code shared by target workers and the draft service."""
