"""Tasks: what an artifact is for (embed, classify, zero-shot, generate, seq2seq), each over one engine.

Inputs that become tensors (text, images, audio) live in :mod:`.inputs`.
"""
