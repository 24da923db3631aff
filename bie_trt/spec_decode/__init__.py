"""Speculative decoding: proposers guess the next tokens, the target verifies them in one forward,
and exact rejection sampling keeps the output distribution the target's own."""
