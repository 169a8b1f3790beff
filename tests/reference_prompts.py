"""The held-in reference prompts (tests/conftest.py tokenises them; benchmarks/gpu_check.py
imports them without pytest)."""

REFERENCE_TEXTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village nestled between two mountains, there lived a",
    "日本の首都は東京です。フランスの首都は",
    "1, 2, 3, 5, 8, 13, 21, 34,",
]
REFERENCE_NEW_TOKENS = 32
