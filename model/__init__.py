"""Llama-style decoder with selectable attention: full, SWA, SA (stochastic) and gated SA+SWA."""
